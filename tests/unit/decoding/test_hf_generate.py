"""Greedy `expertax.decoding.generate` against transformers' `generate(do_sample=False)`.

Tiny random DeepSeek-V3 (MLA with and without q-LoRA, YaRN, sigmoid routing with its correction
bias, groups, a shared expert, one dense layer), Mixtral (GQA, softmax top-2) and Qwen3-MoE (GQA
with per-head q/k RMSNorm, softmax top-3 with and without renormalization, default RoPE and
YaRN), GLM-4.5 (GQA with q/k/v biases, the q/k norm and partial RoPE on DeepSeek's MoE stack)
and DeepSeek-V2 (MLA without q LoRA, softmax group-limited routing) models are built and saved
with transformers (tests/parity/hf_models.py) and read with `expertax.load_hf`, float32 on both
sides. Three prompts of different lengths (one past YaRN's original 128
positions) decode together in one expertax batch (right-padded, one device); transformers
decodes each prompt alone (no padding to get wrong on the reference side). The EOS id given to
both is a token that one prompt's continuation reaches after a few steps: that sequence stops
while the others go on. MLA models run with both cache forms (compressed and plain).

Near-ties: the new tokens must be identical. Where the two sequences first differ, the test
accepts the difference only if it is a genuine near-tie of float32 arithmetic: on the common
prefix, teacher-forced (a full forward pass of each library, no cache), both libraries' logits
for the next token agree within TOLERANCE and transformers' logit of the token expertax chose
is within NEAR_TIE of its largest. Anything else fails. After such a tie the sequences
continue from different tokens, so the rest of that sequence is not compared; the test also
requires most of the budget to have been compared, so that ties cannot hide a bug.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest

pytest.importorskip("torch", reason="parity tests need torch (pip install expertax[parity])")
pytest.importorskip("transformers", reason="parity tests need transformers (extra 'parity')")

import torch  # noqa: E402

import expertax  # noqa: E402
from expertax.decoding import generate  # noqa: E402
from tests.parity.hf_models import VOCAB, build, save  # noqa: E402

pytestmark = pytest.mark.parity

NEW_TOKENS = 16
PROMPT_LENGTHS = (5, 150, 33)
# Max abs logit difference, expertax vs transformers, float32 (as tests/parity/test_hf.py).
TOLERANCE = 1e-4
# The largest gap between transformers' top logit and expertax's choice that counts as a tie.
NEAR_TIE = 1e-4
# Share of all new tokens that must have been compared token for token (before any tie).
MIN_COMPARED = 0.75
CASES = [
    ("deepseek-qlora", "compressed"),
    ("deepseek-qlora", "plain"),
    ("deepseek-plain-q", "compressed"),
    ("mixtral", "compressed"),  # GQA: one cache form
    ("qwen3", "compressed"),  # GQA with the per-head q/k norm: the cache holds normed keys
    ("qwen3-yarn", "compressed"),  # ... with YaRN and unnormalized top-k weights
    ("glm", "compressed"),  # GLM-4.5: GQA with q/k/v biases, q/k norm, partial RoPE; DeepSeek MoE
    ("deepseek-v2-groups", "compressed"),  # MLA without q LoRA, softmax group-limited routing
]


@dataclasses.dataclass
class Reference:
    hf: torch.nn.Module
    config: object  # expertax Config
    params: object  # expertax parameters
    prompts: list[list[int]]
    eos: int
    tokens: list[list[int]]  # transformers' new tokens per prompt
    logprobs: list[list[float]]  # ... and their log-probabilities


@torch.no_grad()
def hf_generate(model, prompt: list[int], eos: int) -> tuple[list[int], list[float]]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        eos_token_id=eos,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [
        float(torch.log_softmax(step[0].double(), -1)[t]) for step, t in zip(out.logits, tokens)
    ]
    return tokens, logprobs


def stop_token(model, prompts: list[list[int]]) -> int:
    """An EOS id for the test: a token that prompt 1's greedy continuation reaches after a few
    steps, the one that cuts the continuations of all prompts least (most tokens compared)."""
    free = [hf_generate(model, p, VOCAB)[0] for p in prompts]  # VOCAB: no such id, no stop

    def kept(t: int) -> int:
        return sum(seq.index(t) if t in seq else NEW_TOKENS for seq in free)

    first = [t for j, t in enumerate(free[1]) if 3 <= j < NEW_TOKENS - 1 and t not in free[1][:j]]
    return max(first, key=kept)


@pytest.fixture(scope="module")
def refs(tmp_path_factory) -> dict[str, Reference]:
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    out = {}
    for i, kind in enumerate(sorted({k for k, _ in CASES})):
        model = build(kind, seed=i)
        config, params = expertax.load_hf(save(model, Path(tmp_path_factory.mktemp(kind))))
        # max_target_length is a data key that load_hf leaves at its default (128); generate
        # refuses prompts longer than it.
        config = config.model_copy(
            update=dict(
                dtype="float32",
                weight_dtype="float32",
                max_target_length=max(PROMPT_LENGTHS) + NEW_TOKENS,
            )
        )
        eos = stop_token(model, prompts)
        ref = [hf_generate(model, p, eos) for p in prompts]
        assert len(ref[1][0]) < NEW_TOKENS  # one sequence stops early, the others go on
        out[kind] = Reference(
            model, config, params, prompts, eos, [t for t, _ in ref], [lp for _, lp in ref]
        )
    return out


@torch.no_grad()
def check_near_tie(ref: Reference, params, prompt, prefix, ours: int, theirs: int) -> float:
    """AssertionError unless `ours` against transformers' `theirs` after prompt + prefix is a
    near-tie (module doc); returns transformers' logit gap between the two."""
    seq = [*prompt, *prefix]
    hf_V = ref.hf(torch.tensor([seq])).logits[0, -1].double().numpy()
    ex_V = np.asarray(expertax.logits(params, np.array([seq], np.int32), ref.config))[0, -1]
    diff = float(np.max(np.abs(hf_V - ex_V)))
    assert diff <= TOLERANCE, (
        f"after {len(prefix)} new tokens: expertax chose {ours}, transformers {theirs}, and the "
        f"teacher-forced logits differ by {diff:.3g} > {TOLERANCE}: not a float32 tie"
    )
    gap = float(hf_V.max() - hf_V[ours])
    assert int(np.argmax(hf_V)) == theirs and gap < NEAR_TIE, (
        f"after {len(prefix)} new tokens: expertax chose {ours}, transformers {theirs}; "
        f"transformers' logit gap between them is {gap:.3g} >= {NEAR_TIE}: not a near tie"
    )
    return gap


def compare(ref: Reference, params, tokens, logprobs) -> int:
    """Tokens and their log-probabilities against transformers' up to the first near tie
    (`check_near_tie`); returns how many tokens were compared."""
    compared = 0
    for i, prompt in enumerate(ref.prompts):
        ours, theirs = tokens[i], ref.tokens[i]
        k = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if k is None:
            assert ours == theirs, f"prompt {i}: {ours} against transformers' {theirs}"
            k = len(ours)
        else:
            check_near_tie(ref, params, prompt, ours[:k], ours[k], theirs[k])
        np.testing.assert_allclose(logprobs[i][:k], ref.logprobs[i][:k], atol=TOLERANCE, rtol=0)
        compared += k
    return compared


def run(ref: Reference, params, form: str):
    return generate(
        params,
        ref.config,
        ref.prompts,
        max_new_tokens=NEW_TOKENS,
        eos_id=ref.eos,
        mla_cache=form,
        devices=jax.devices()[:1],
    )


@pytest.mark.parametrize(("kind", "form"), CASES)
def test_greedy_matches_transformers(refs, kind, form):
    ref = refs[kind]
    out = run(ref, ref.params, form)
    compared = compare(ref, ref.params, out.tokens, out.logprobs)
    total = sum(len(t) for t in ref.tokens)
    print(f"\n{kind} {form}: {compared} of {total} new tokens compared")
    assert compared >= MIN_COMPARED * total
    assert out.finished == [t[-1] == ref.eos for t in ref.tokens]
    assert len(out.tokens[1]) < NEW_TOKENS
    assert ref.config.attention_type == ("mla" if kind.startswith("deepseek") else "gqa")


def _zero_routing_bias(layers):
    moe = layers.moe
    router = dataclasses.replace(moe.router, bias=moe.router.bias * 0)
    return dataclasses.replace(layers, moe=dataclasses.replace(moe, router=router))


def _perturbed_key_norm(layers):
    attn = dataclasses.replace(layers.attn, k_norm=layers.attn.k_norm.at[1, 0].multiply(1.05))
    return dataclasses.replace(layers, attn=attn)


@pytest.mark.parametrize(
    ("kind", "change", "failure"),
    [
        ("deepseek-qlora", _zero_routing_bias, "not a float32 tie"),
        ("qwen3", _perturbed_key_norm, "Not equal to tolerance"),
    ],
    ids=["routing-bias", "key-norm"],
)
def test_wrong_weights_fail(refs, kind, change, failure):
    """Negative controls, the comparison must fail: DeepSeek's routing bias zeroed in
    expertax's copy changes the chosen experts (not passed as a near tie); Qwen3's key norm 5 %
    larger on one channel of the last layer (the keys that prefill writes to the cache and
    decoding reads) leaves the greedy tokens but not their log-probabilities."""
    ref = refs[kind]
    params = dataclasses.replace(ref.params, moe_layers=change(ref.params.moe_layers))
    out = run(ref, params, "compressed")
    assert (out.tokens != ref.tokens) == (kind == "deepseek-qlora")
    with pytest.raises(AssertionError, match=failure):
        compare(ref, params, out.tokens, out.logprobs)


def test_near_tie_check(refs):
    """The tie check itself: a different first token is refused where transformers' logits do
    not tie, and accepted where they do (a copy of the model with the other token's output
    row made equal to that of transformers' choice, on both sides)."""
    ref = refs["mixtral"]
    prompt, theirs = ref.prompts[0], ref.tokens[0][0]
    other = (theirs + 1) % VOCAB
    with pytest.raises(AssertionError, match="not a near tie"):
        check_near_tie(ref, ref.params, prompt, [], other, theirs)

    tied = copy.deepcopy(ref.hf)
    with torch.no_grad():
        tied.lm_head.weight[other] = tied.lm_head.weight[theirs]
    head_DV = ref.params.lm_head
    params = dataclasses.replace(ref.params, lm_head=head_DV.at[:, other].set(head_DV[:, theirs]))
    gap = check_near_tie(dataclasses.replace(ref, hf=tied), params, prompt, [], other, theirs)
    assert gap < NEAR_TIE
