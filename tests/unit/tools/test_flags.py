"""The tools' comma-list flags: every malformed entry refused naming the flag, the value and what
is valid; the well-formed values read as given."""

from __future__ import annotations

import pytest

from expertax.errors import ConfigError
from expertax.tools.flags import token_ids


@pytest.mark.parametrize(
    "text, words",
    [
        ("1,,2", ["entry 2 is empty"]),
        ("1,2,", ["entry 3 is empty"]),
        ("", ["entry 1 is empty"]),
        ("1,x", ["'x' is not a non-negative integer"]),
        ("1,-3", ["'-3' is not a non-negative integer"]),
        ("1.5", ["'1.5' is not a non-negative integer"]),
        ("1,٣", ["'٣' is not a non-negative integer"]),  # a digit, but not an ASCII one
        ("1,64", ["64 is not below the vocab size (64)"]),
    ],
)
def test_malformed_token_ids_are_refused_naming_flag_value_and_rule(text, words):
    with pytest.raises(ConfigError) as e:
        token_ids("--prompt-ids", text, vocab_size=64)
    msg = str(e.value)
    assert msg.startswith(f"--prompt-ids={text!r}: "), msg
    assert "use comma-separated non-negative integer token ids below the vocab size" in msg
    for word in words:
        assert word in msg, msg


def test_well_formed_token_ids_are_read_as_given():
    """Negative control: commas, spaces around them, spaces alone, the largest id."""
    assert token_ids("--prompt-ids", "1,15,27") == [1, 15, 27]
    assert token_ids("--prompt-ids", " 1, 15 ,27 ") == [1, 15, 27]
    assert token_ids("--prompt-ids", "1 15 27") == [1, 15, 27]
    assert token_ids("--prompt-ids", "0,63", vocab_size=64) == [0, 63]
    assert token_ids("--prompt-ids", "640") == [640]  # without a vocabulary, the form alone
