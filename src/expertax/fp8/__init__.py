"""fp8 training and weights, one package.

- `quant`: the format: e4m3, the scale rule, the block quantizer shared with the checkpoint
  converter (convert/fp8.py) and decoding's fp8 weights (decoding/quantized.py), and the device
  layout of an fp8 weight (`Fp8`);
- `recipes`: the training recipes (`fp8_tensorwise`, `fp8_blockwise`): how a GEMM's operand is
  quantized;
- `matmul`: the one custom VJP of the quantized GEMMs, a dense linear being the routed experts'
  grouped GEMM with one group; `products`: where each of its three products runs;
- `experts`: the MoE layer's one seam, its expert products chosen once per layer (plain, or
  under the recipe), and what the paged stash holds of them;
- `stats`: what the quantizers lose in a step, carried out of the VJPs by a probe;
- `kernel`: where each product runs (Hopper's tensor cores or dequantized), and the checks of
  `gmm_impl=fp8_hopper`;
- `compiled`: which kernel runs each fp8 product of a compiled program (the scopes read back);
- `hopper/`: the Pallas Mosaic GPU kernels, imported only where `kernel` assigns them a product.
"""
