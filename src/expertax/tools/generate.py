"""`expertax generate SOURCE --prompt TEXT ...`: the command's work (its parser is in
expertax/cli/generate.py). See docs/design/generate.md.

Everything the user gave is checked before the parameters are read or anything compiles: the
`--json` path (by the command line, before JAX loads: expertax/outputs.py), the source
(tools/generate_source.py), the overrides, the prompts (a text prompt needs a tokenizer), the
sampling settings and lengths (`check_request`). Then the parameters are read into the mesh of
all the devices JAX sees, `generate` runs once over every prompt, and each prompt's continuation
is printed (text when there is a tokenizer, else ids) with a summary line;
`--json` also writes them, with the ids and log-probabilities.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from expertax import jsonio, paths, preflight
from expertax.data import rollouts
from expertax.decoding.loop import Generation, check_request, decoding_config, generate
from expertax.errors import ConfigError
from expertax.sharding.mesh import make_mesh
from expertax.tools.flags import token_ids
from expertax.tools.generate_source import SYNTHETIC_TOKENIZER, Source, load_params, open_source

# The command's sampling flags, as `generate`'s keyword arguments.
SETTINGS = (
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "mla_cache",
    "speculative",
    "fp8_weights",
    "prefill_chunk",
)


@dataclasses.dataclass(frozen=True)
class Prompt:
    text: str | None  # as given (None for an ids prompt)
    ids: list[int]  # what the model reads: BOS + the encoded text, or the ids as given


def read_prompts_file(path: str) -> list[tuple[str, Any]]:
    """The prompts of a JSON-lines file: each line {"prompt": "text"} or {"ids": [1, 15, 27]}."""
    if not path.strip():
        raise ConfigError(f"--prompts-file={path!r} is empty; give a JSON-lines file")
    text = paths.read_text(f"--prompts-file={path!r}", path, "give a JSON-lines file")
    entries: list[tuple[str, Any]] = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"--prompts-file={path!r} line {n}"
        try:
            item = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"{where}: not JSON ({e})") from None
        unknown = sorted(set(item) - {"prompt", "ids"}) if isinstance(item, dict) else []
        if unknown:
            raise ConfigError(
                f'{where}: unknown key {unknown[0]!r}; a line is {{"prompt": "text"}} or '
                '{"ids": [1, 15, 27]}'
            )
        if isinstance(item, dict) and isinstance(item.get("prompt"), str) and "ids" not in item:
            entries.append(("text", item["prompt"]))
        elif isinstance(item, dict) and isinstance(item.get("ids"), list) and "prompt" not in item:
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in item["ids"]):
                raise ConfigError(f'{where}: "ids" must be a list of integers')
            entries.append(("ids", list(item["ids"])))
        else:
            raise ConfigError(
                f'{where}: expected {{"prompt": "text"}} or {{"ids": [1, 15, 27]}}, got {line!r}'
            )
    return entries


def make_prompts(entries: Sequence[tuple[str, Any]], source: Source) -> list[Prompt]:
    """Text prompts encoded as training frames a document (BOS, then the text's tokens without
    the tokenizer's own special tokens); id prompts as given."""
    prompts = []
    for kind, value in entries:
        if kind == "ids":
            vocab = source.config.vocab_size
            ids = value if isinstance(value, list) else token_ids("--prompt-ids", value, vocab)
            prompts.append(Prompt(None, ids))
            continue
        if source.tokenizer is None:
            raise ConfigError(
                f"--prompt {value!r}: text needs a tokenizer and {source.describe()} has none "
                "(a run folder's tokenizer_path, a model directory's tokenizer.json); give "
                "--tokenizer PATH, or the prompt as token ids with --prompt-ids 1,15,27"
            )
        try:
            ids = source.tokenizer.encode(value, add_special_tokens=False).ids
        except Exception as e:  # the Rust side raises a bare Exception (an unknown word)
            hint = (
                f"; this run's text is whole numbers from 0 to {source.config.vocab_size - 1} "
                'separated by spaces, e.g. "3 5 7 9 11"'
                if source.tokenizer_path == SYNTHETIC_TOKENIZER
                else ""
            )
            raise ConfigError(
                f"--prompt {value!r}: the tokenizer ({source.tokenizer_path}) cannot encode it "
                f"({e}){hint}"
            ) from None
        bos = [] if source.bos_id is None else [source.bos_id]
        prompts.append(Prompt(value, bos + list(ids)))
    return prompts


def describe_mesh(mesh) -> str:
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    axes = " ".join(f"{a}={n}" for a, n in sizes.items() if n > 1) or "one device"
    devices = list(mesh.devices.flat)
    plural = "s" if len(devices) > 1 else ""
    return f"mesh {axes} over {len(devices)} {devices[0].platform} device{plural}"


def decode_text(source: Source, ids: list[int]) -> str | None:
    """The text of `ids` without special tokens (None without a tokenizer); ids the tokenizer
    does not have (a model vocabulary padded past the tokenizer's) add nothing."""
    if source.tokenizer is None:
        return None
    return source.tokenizer.decode(ids, skip_special_tokens=True)


def _unknown(source: Source, ids: list[int]) -> int:
    tok = source.tokenizer
    return 0 if tok is None else sum(tok.id_to_token(i) is None for i in ids)


def report(
    source: Source,
    prompts: list[Prompt],
    gen: Generation,
    settings: dict,
    mesh: str,
    seconds: float,
) -> dict:
    """The JSON document of a run (what --json writes)."""
    results = [
        {
            "prompt": p.text,
            "prompt_ids": p.ids,
            "ids": ids,
            "text": decode_text(source, ids),
            "logprobs": lp,
            "finished": done,
        }
        for p, ids, lp, done in zip(prompts, gen.tokens, gen.logprobs, gen.finished, strict=True)
    ]
    return {
        "source": str(source.path),
        "source_kind": source.kind,
        "step": source.step,
        "tokenizer": source.tokenizer_path,
        "settings": {**settings, "eos_id": source.eos_id, "bos_id": source.bos_id},
        "mesh": mesh,
        "seconds": round(seconds, 3),
        "tokens_generated": sum(len(t) for t in gen.tokens),
        "drafts_proposed": gen.drafts_proposed,
        "drafts_accepted": gen.drafts_accepted,
        "acceptance": gen.acceptance,
        "results": results,
    }


def _ids(ids: list[int]) -> str:
    return "ids " + " ".join(map(str, ids))


def print_results(source: Source, doc: dict, out=None) -> None:
    """Each prompt and its continuation (text when there is a tokenizer, else ids), then the
    summary line."""
    out = out or sys.stdout
    for i, r in enumerate(doc["results"]):
        shown = r["prompt"] if r["prompt"] is not None else _ids(r["prompt_ids"])
        print(f"[{i}] prompt ({len(r['prompt_ids'])} tokens): {shown}", file=out)
        stop = "EOS" if r["finished"] else "budget"
        body = r["text"] if r["text"] is not None else _ids(r["ids"])
        unknown = _unknown(source, r["ids"])
        if unknown:
            body += f" [+{unknown} ids outside the tokenizer's vocabulary: see --json]"
        print(f"[{i}] continuation ({len(r['ids'])} tokens, stopped at {stop}): {body}", file=out)
    n, seconds = doc["tokens_generated"], doc["seconds"]
    rate = n / seconds if seconds > 0 else 0.0
    line = (
        f"expertax: {n} tokens for {len(doc['results'])} prompt(s) in {seconds:.2f} s, reading "
        f"the parameters and compiling included ({rate:.1f} tokens/s)"
    )
    if doc["acceptance"] is not None:
        line += (
            f"; MTP drafts accepted {doc['drafts_accepted']}/{doc['drafts_proposed']} "
            f"({100 * doc['acceptance']:.1f} %)"
        )
    print(line, file=out)


def say_flag(setting: str, value: Any) -> str:
    """A setting as the command line gives it: `--max-new-tokens=32`, `--speculative`."""
    flag = "--" + setting.replace("_", "-")
    return flag if value is None or value is True else f"{flag}={value}"


def run(args) -> int:
    """`expertax generate` with parsed `args` (expertax/cli/generate.py); a user error is a
    ConfigError."""
    entries = list(args.prompts or [])
    if args.prompts_file is not None:  # before the source: a bad file costs no read of it
        entries += read_prompts_file(args.prompts_file)
    source = open_source(args.source, args.config, args.tokenizer)
    prompts = make_prompts(entries, source)
    settings = {name: getattr(args, name) for name in SETTINGS}
    c = source.config
    request = {k: v for k, v in settings.items() if k not in ("seed", "fp8_weights")}
    record = args.record_routing is not None
    check_request(
        c, [p.ids for p in prompts], **request, max_length=source.max_length, say=say_flag,
        record_routing=record,
    )  # fmt: skip

    decoding = decoding_config(c)
    mesh = make_mesh(decoding)
    preflight.check_kernels(decoding, mesh)  # before any compile
    mesh_line = describe_mesh(mesh)
    print(f"expertax: {source.describe()}; {mesh_line}")
    start = time.perf_counter()
    params, source = load_params(source, mesh)  # the step read, where the newest did not
    gen = generate(
        params,
        c,
        [p.ids for p in prompts],
        **settings,
        eos_id=source.eos_id,
        max_length=source.max_length,
        record_routing=record,
    )
    doc = report(source, prompts, gen, settings, mesh_line, time.perf_counter() - start)
    print_results(source, doc)
    if args.json:
        Path(args.json).write_text(jsonio.dumps(doc, indent=1) + "\n")
    if record:
        rollouts.write(args.record_routing, recording(c, prompts, gen))
        print(f"expertax: the routing of {len(prompts)} sequence(s) in {args.record_routing}")
    return 0


def recording(c, prompts: list[Prompt], gen: Generation) -> rollouts.Recording:
    """The sampled sequences (prompt then new tokens) with the routing the sampler used."""
    assert gen.routing is not None
    seqs = [
        rollouts.Rollout(np.asarray(p.ids + ids, np.int32), len(p.ids), r)
        for p, ids, r in zip(prompts, gen.tokens, gen.routing, strict=True)
    ]
    return rollouts.Recording(seqs, c.num_moe_layers, c.num_experts_per_tok, c.num_experts)
