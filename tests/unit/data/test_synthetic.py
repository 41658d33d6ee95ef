"""The synthetic stream: the plain sequences unchanged, and `noise`'s replaced targets."""

import numpy as np
import pytest

from expertax.data.synthetic import SyntheticData, loss_floor

V, T, B, SEED = 512, 128, 64, 7


def data(noise: float = 0.0, seed: int = SEED, **rows) -> SyntheticData:
    return SyntheticData(vocab_size=V, seq_len=T, global_batch=B, seed=seed, noise=noise, **rows)


def test_without_noise_the_batches_are_the_arithmetic_sequences_bit_for_bit():
    for step in (0, 5):
        rng = np.random.default_rng([SEED, step])
        a = rng.integers(0, V, size=B)
        b = rng.integers(1, 8, size=B)
        seq = ((a[:, None] + b[:, None] * np.arange(T + 1)[None, :]) % V).astype(np.int32)
        batch = data().batch_at(step)
        assert batch["inputs"].dtype == batch["targets"].dtype == np.int32
        np.testing.assert_array_equal(batch["inputs"], seq[:, :-1])
        np.testing.assert_array_equal(batch["targets"], seq[:, 1:])


def test_noise_replaces_about_p_of_the_targets_and_nothing_else():
    p = 0.3
    clean, noisy = data().batch_at(3), data(p).batch_at(3)
    for key in ("inputs", "segment_ids", "positions", "weights"):
        np.testing.assert_array_equal(noisy[key], clean[key])
    changed = noisy["targets"] != clean["targets"]
    # a replacement draws the right token with chance 1/V; 8192 tokens: std of the share 0.005
    assert abs(changed.mean() - p * (1 - 1 / V)) < 0.02
    assert 0 <= noisy["targets"].min() and noisy["targets"].max() < V
    # the replaced positions differ between rows (each row has its own draw)
    assert not np.array_equal(changed[0], changed[1])


def replaced(p: float, step: int, seed: int = SEED) -> np.ndarray:
    return data(p, seed).batch_at(step)["targets"] != data(0.0, seed).batch_at(step)["targets"]


def test_noise_is_a_function_of_seed_step_and_row():
    p = 0.3
    whole = data(p).batch_at(4)["targets"]
    np.testing.assert_array_equal(data(p).batch_at(4)["targets"], whole)
    # two processes' shares, made apart, are the whole batch's rows
    shares = [data(p, row_start=r, rows=B // 2).batch_at(4)["targets"] for r in (0, B // 2)]
    np.testing.assert_array_equal(np.concatenate(shares), whole)
    # another step or seed replaces other positions (negative controls)
    assert not np.array_equal(replaced(p, 5), replaced(p, 4))
    assert not np.array_equal(replaced(p, 4, SEED + 1), replaced(p, 4))


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_loss_floor_is_the_mixtures_entropy(p):
    q = np.full(V, p / V)
    q[0] += 1 - p
    assert loss_floor(p, V) == pytest.approx(float(-(q * np.log(q)).sum()), rel=1e-12)
    assert loss_floor(0.0, V) == 0.0


def test_the_mixture_prediction_scores_the_floor_on_noisy_data():
    """The cross-entropy of (1-p) on the clean token + p/V on each, on 32768 noisy targets, is the
    floor (std of the mean 0.018 nats); the floor of another p is not (negative control)."""
    p = 0.3
    big = dict(vocab_size=V, seq_len=T, global_batch=256, seed=SEED)
    clean = SyntheticData(**big).batch_at(0)["targets"]
    noisy = SyntheticData(**big, noise=p).batch_at(0)["targets"]
    right = np.log(1 - p + p / V)
    nll = -np.where(noisy == clean, right, np.log(p / V)).mean()
    assert abs(nll - loss_floor(p, V)) < 0.06
    assert abs(nll - loss_floor(0.35, V)) > 0.2
