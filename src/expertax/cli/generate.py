"""`expertax generate SOURCE --prompt TEXT ...`: the flags; the command is tools/generate.py."""

from __future__ import annotations

import argparse

from expertax import startup
from expertax.cli import flags
from expertax.outputs import add_overwrite_flag, check_apart, check_file

HELP = (
    "continue prompts: expertax generate SOURCE --prompt TEXT | --prompt-ids 1,15,27 ... "
    "(SOURCE: a training run folder or a from-hf model directory)"
)
# The numeric flags' valid values (checked before any work: cli/flags.py).
LIMITS = {
    "--max-new-tokens": flags.count(1, "tokens generated per prompt"),
    "--temperature": flags.Limit(0, what="0: greedy"),
    "--top-k": flags.count(0, "0: no top-k filter"),
    "--top-p": flags.Limit(0, 1, low_open=True, what="nucleus sampling mass"),
    "--seed": flags.Limit(0, 2**32, high_open=True, integer=True, what="sampling seed"),
    "--prefill-chunk": flags.count(1, "prompt positions per prefill step"),
}
# The text and path flags' kinds (cli/flags.py TEXT_KINDS: what each takes and must refuse).
KINDS = {
    "--prompt": "free text",
    "--prompt-ids": "token ids",
    "--prompts-file": "input json",
    "--json": "output file",
    "--record-routing": "output file",
    "--tokenizer": "tokenizer",
}


# The flags read only when sampling (--temperature > 0), with their defaults: at temperature 0
# decoding is greedy and they would do nothing, so another value is refused there.
SAMPLING_ONLY = {"--top-k": 0, "--top-p": 1.0, "--seed": 0}


def _text_prompt(text: str) -> tuple[str, str]:
    return ("text", text)


def _ids_prompt(ids: str) -> tuple[str, str]:
    return ("ids", ids)


def add_parser(sub) -> argparse.ArgumentParser:
    gen = sub.add_parser(
        "generate",
        help=HELP,
        description="Continue each prompt with the model of SOURCE (greedy at temperature 0) on "
        "all the devices JAX sees; print the continuations and a summary. Checked before "
        "compiling. docs/design/generate.md.",
    )
    gen.add_argument(
        "source",
        help="a training run folder (<base_output_directory>/<run_name>: its latest complete "
        "checkpoint) or an expertax model directory (expertax convert from-hf)",
    )
    gen.add_argument(
        "config",
        nargs="*",
        help="key=value overrides of keys that leave the model as it is: layout keys (mesh "
        "ici_*_parallelism, sharding_rules, attention_impl, ...), dtype, sparse_matmul, "
        "max_target_length",
    )
    gen.add_argument(
        "--prompt",
        dest="prompts",
        action="append",
        type=_text_prompt,
        metavar="TEXT",
        help="a text prompt (repeatable; encoded with the tokenizer, BOS first when it has one)",
    )
    gen.add_argument(
        "--prompt-ids",
        dest="prompts",
        action="append",
        type=_ids_prompt,
        metavar="IDS",
        help="a prompt as token ids: comma-separated non-negative integers below the vocab size, "
        "e.g. 1,15,27 (repeatable)",
    )
    gen.add_argument(
        "--prompts-file",
        help='JSON lines, each {"prompt": "text"} or {"ids": [1, 15, 27]} (after the flags\' ones)',
    )
    gen.add_argument("--max-new-tokens", type=int, default=32, help="per prompt (default 32)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    gen.add_argument(
        "--top-k",
        type=int,
        default=SAMPLING_ONLY["--top-k"],
        help="sampling: from the k most likely (0: all)",
    )
    gen.add_argument(
        "--top-p",
        type=float,
        default=SAMPLING_ONLY["--top-p"],
        help="sampling: the nucleus's probability mass, in (0, 1]",
    )
    gen.add_argument(
        "--seed", type=int, default=SAMPLING_ONLY["--seed"], help="sampling seed (default 0)"
    )
    gen.add_argument("--json", help="also write prompts, ids, text, log-probs and settings here")
    gen.add_argument(
        "--record-routing",
        metavar="FILE",
        help="also write each sequence's tokens and the experts the decode program's MoE "
        "routers chose for every token (.npz, data/rollouts.py), for routing replay in training",
    )
    add_overwrite_flag(gen)
    gen.add_argument(
        "--mla-cache",
        choices=("compressed", "plain"),
        default="compressed",
        help="MLA models: cache the latent (compressed, default) or per-head keys and values",
    )
    gen.add_argument(
        "--speculative",
        action="store_true",
        help="greedy speculative decoding with the model's MTP module drafting one token a step",
    )
    gen.add_argument(
        "--fp8-weights",
        action="store_true",
        help="hold the layers' matrices in fp8 with block scales (half of bfloat16's memory)",
    )
    gen.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="prompt positions per prefill step (default 512); smaller holds less memory",
    )
    gen.add_argument(
        "--tokenizer",
        help="a tokenizer.json (or its folder), instead of the run's tokenizer_path or the model "
        "directory's tokenizer.json",
    )
    return gen


def _check_tokenizer(path: str) -> None:
    """ConfigError naming --tokenizer when `path` is not a tokenizer.json (or a folder of one)."""
    from expertax.config import ConfigError
    from expertax.data.tokenizer import load_tokenizer

    try:
        load_tokenizer(path)
    except ValueError as e:
        why = str(e).split(": ", 1)[-1]  # after load_tokenizer's own "tokenizer_path=...: "
        raise ConfigError(f"--tokenizer={path!r}: {why}") from None


def _check_sampling_flags(args) -> None:
    from expertax.config import ConfigError

    if args.temperature != 0:
        return
    for flag, default in SAMPLING_ONLY.items():
        value = getattr(args, flags.dest(flag))
        if value != default:
            raise ConfigError(
                f"{flag}={value} is read when sampling only; at --temperature 0 (the default) "
                f"decoding is greedy: add --temperature T > 0 to sample, or leave {flag} out"
            )


def run(args) -> int:
    _check_sampling_flags(args)
    inputs = {"SOURCE": args.source, "--prompts-file": args.prompts_file}
    outputs = {"--json": args.json, "--record-routing": args.record_routing}
    check_apart(outputs, {**inputs, "--tokenizer": args.tokenizer})
    check_file("--json", args.json, args.overwrite)  # before JAX loads
    check_file("--record-routing", args.record_routing, args.overwrite)
    from expertax.tools.flags import token_ids

    for kind, value in args.prompts or []:
        if kind == "ids":  # the form now; the vocabulary size once the source is read
            token_ids("--prompt-ids", value)
    if args.tokenizer is not None:  # before the source is read
        _check_tokenizer(args.tokenizer)
    from expertax.tools import generate

    startup.start_backends()
    return generate.run(args)
