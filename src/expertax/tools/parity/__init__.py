"""`expertax parity`: one model trained under many layouts against a single-device reference.

- `layouts`: the layout matrix, `--layouts` names and each layout's config;
- `run`: training a layout and comparing its losses with the reference (`parity_table`);
- `routing`: the routing probe (flips against the reference, the imposed-routing loss);
- `table`: the markdown table and the JSON report;
- `compile_only`: `--compile-only`, every layout compiled for a target, nothing run.
"""
