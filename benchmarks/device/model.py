"""The device check's model sections: a train step of the largest DeepSeek-V3-shaped model that
fits one GPU, under the plan `expertax memory --fit` chose for that GPU (plans.json, made on a CPU
machine by plan.py with the GPU's own compiler), and decoding from it at batch 1 and 32.

The model (`MODEL`): DeepSeek-V3's layer (MLA with its head dims and latent ranks, 8-of-N sigmoid
routing in groups with the balancing bias, one shared expert, a dense first layer, its 129,280
vocabulary) at width 2048 with 64 routed experts of 1024; plans.json holds, per GPU, the number
of layers plan.py found to fit with the planner's layout, remat and chunks, and the figures its
compile predicted. Float32 master weights, bfloat16 compute, dropless.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from expertax.data.synthetic import SyntheticData
from expertax.planner import plan as planner
from expertax.preflight import load_config
from expertax.train.metrics import train_flops_per_token
from expertax.train.trainer import build_trainer

HERE = Path(__file__).parent
PLANS = HERE / "plans.json"
GIB = 1024**3

MODEL = {
    "model_name": "deepseek3-671b",
    "base_emb_dim": 2048,
    "base_num_query_heads": 16,
    "base_num_kv_heads": 16,
    "q_lora_rank": 768,
    "base_mlp_dim": 8192,
    "base_moe_mlp_dim": 1024,
    "num_experts": 64,
    "first_num_dense_layers": 1,
    "max_target_length": 4096,
    "dtype": "bfloat16",
    "weight_dtype": "float32",
    "steps": 100,
}
DRY_MODEL = {
    "model_name": "deepseek3-tiny",
    "base_num_decoder_layers": 2,
    "max_target_length": 32,
    "per_device_batch_size": 2,
    "steps": 100,
}
DECODE_BATCHES = (1, 32)
DECODE_PROMPT, DECODE_NEW = 128, 64


def plan_for(device_kind: str) -> tuple[str, dict]:
    """(plan name, its entry) for a device kind ("NVIDIA H100 80GB HBM3" -> "h100")."""
    plans = json.loads(PLANS.read_text())
    kind = device_kind.lower()
    for name, entry in plans.items():
        if name in kind:
            return name, entry
    return "h100", plans["h100"]  # another GPU: the smaller plan, named as such in the results


def config_for(ctx):
    if ctx.dry_run:
        return load_config(overrides=DRY_MODEL), {"name": "dry-run"}
    name, entry = plan_for(ctx.device_kind)
    overrides = {**MODEL, **entry["overrides"]}
    return load_config(overrides=overrides), {"name": name, **entry}


def train_step(ctx) -> None:
    """Compile the planned step on this GPU, run it, time it; then decode from its weights."""
    c, chosen = config_for(ctx)
    devices = jax.devices()[:1]
    trainer = build_trainer(c, devices)
    t0 = time.perf_counter()
    compiled = trainer.compile()
    compile_s = time.perf_counter() - t0
    xla = planner.xla_figures(compiled)
    on = jax.devices()[0].platform.replace("cuda", "gpu")
    compiled_peak = planner.device_peak(c, trainer.abstract_state(), xla, on=on)[0]
    state = trainer.init_state()
    step = compiled  # the program the plan was read from
    data = SyntheticData(
        vocab_size=c.vocab_size,
        seq_len=c.max_target_length,
        global_batch=trainer.global_batch,
        seed=0,
    )
    times, losses = [], []
    n = 1 if ctx.dry_run else 8
    with trainer.context():
        for i in range(n + 2):
            batch = trainer.put_batch(data.batch_at(i))
            t = time.perf_counter()
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))  # waits for the step
            if i >= 2:  # the first two: warm-up
                times.append(time.perf_counter() - t)
    s = statistics.median(times)
    tokens = trainer.global_batch * c.max_target_length
    flops = train_flops_per_token(c) * tokens
    stats = _memory_stats()
    params = sum(x.size for x in jax.tree.leaves(state.params))
    ctx.emit(
        {
            "section": "train",
            "plan": chosen.get("name"),
            "layers": c.base_num_decoder_layers,
            "parameters": int(params),
            "batch": f"{trainer.global_batch}x{c.max_target_length}",
            "overrides": chosen.get("overrides", {}),
            "compile_s": compile_s,
            "step_s": s,
            "tokens_per_s": tokens / s,
            "model_tflops_per_step": flops / 1e12,
            "mfu_spec": flops / s / (ctx.spec_tflops * 1e12),
            "mfu_measured_peak": (
                None if ctx.dense_tflops is None else flops / s / (ctx.dense_tflops * 1e12)
            ),
            "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
            "compiled_peak_bytes": compiled_peak,
            "planned_peak_bytes": chosen.get("compiled_peak_bytes"),
            "losses": losses,
        }
    )
    params_bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), state.params)
    del state
    decode(ctx, c.model_copy(update={"weight_dtype": "bfloat16"}), params_bf16, devices)


def _memory_stats() -> dict:
    try:
        return dict(jax.devices()[0].memory_stats() or {})
    except Exception:  # noqa: BLE001 - the CPU backend has none
        return {}


def decode(ctx, c, params, devices) -> None:
    """Greedy decode tokens/s at each batch: batch x (new - 1) / (time(new) - time(1)), the
    prefill and the first token taken out (as benchmarks/generate.py)."""
    from expertax.decoding import generate, prepare

    prompt = DECODE_PROMPT if not ctx.dry_run else 8
    new = DECODE_NEW if not ctx.dry_run else 3
    prepared = prepare(params, c, devices=devices)
    rng = np.random.default_rng(0)
    for b in DECODE_BATCHES if not ctx.dry_run else (2,):
        if ctx.out_of_time():
            return
        prompts = rng.integers(0, c.vocab_size, size=(b, prompt)).tolist()
        times = {}
        for k in (1, new):
            run = lambda k=k, prompts=prompts: generate(
                prepared,
                c,
                prompts,
                max_new_tokens=k,
                devices=devices,
                max_length=prompt + new,
            )
            run()  # compile
            samples = []
            for _ in range(1 if ctx.dry_run else 3):
                t = time.perf_counter()
                run()
                samples.append(time.perf_counter() - t)
            times[k] = statistics.median(samples)
        ctx.emit(
            {
                "section": "decode",
                "batch": b,
                "prompt": prompt,
                "new_tokens": new,
                "prefill_s": times[1],
                "tokens_per_s": b * (new - 1) / max(times[new] - times[1], 1e-9),
            }
        )
