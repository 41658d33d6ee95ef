"""What the refusals suggest instead."""

from __future__ import annotations


def divisors(n: int, limit: int = 64) -> list[int]:
    """The four largest divisors of `n` up to `limit`: the counts a refusal suggests for a key
    that must divide `n`."""
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0][-4:]
