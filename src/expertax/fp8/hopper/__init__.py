"""fp8 GEMMs on Hopper's tensor cores (Pallas Mosaic GPU, e4m3 `wgmma`, sm_90a: H100, H200),
one module per kernel: `gmm` (the fprop and the dgrad of a grouped GEMM, a dense linear being
its one-group case), `wgrad` (the weight gradient), `layout` (each group's rows padded to whole
row tiles), `mosaic` (what the kernels share).

Imported only where fp8/kernel.py assigns a product to them: the layers import fp8/matmul.py,
which imports these modules inside the branch that runs them, so a process that never runs
a Hopper kernel never imports Pallas's Mosaic GPU.
"""
