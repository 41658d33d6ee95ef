"""Loading a HuggingFace `tokenizers` tokenizer and finding its document-boundary tokens.

Documents are encoded *without* the tokenizer's own post-processor (`add_special_tokens=False`),
then framed by `encode_document`: the BOS id (if the tokenizer defines one) is prepended and the EOS
id (if it defines one) is appended. Doing it here, not through the tokenizer's template, means every
tokenizer is framed the same way and nothing is added twice. See docs/design/data.md.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import tokenizers

from expertax.paths import not_a_file

# Spellings of the end- and beginning-of-document tokens in common tokenizers (GPT-2/NeoX/Qwen,
# Llama/Mistral/Mixtral, Llama 3, Gemma, DeepSeek). The first one in the vocabulary is used.
EOS_CANDIDATES = (
    "<|endoftext|>",
    "</s>",
    "<|end_of_text|>",
    "<｜end▁of▁sentence｜>",
    "<eos>",
    "[EOS]",
    "<|eos|>",
)
BOS_CANDIDATES = (
    "<s>",
    "<|begin_of_text|>",
    "<｜begin▁of▁sentence｜>",
    "<bos>",
    "[BOS]",
    "<|bos|>",
)


def load_tokenizer(path: str) -> tokenizers.Tokenizer:
    """Loads a `tokenizer.json` file, or the `tokenizer.json` inside a directory.

    Raises:
      ValueError: naming `tokenizer_path` and the value when the file is missing or unreadable.
    """
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    why = not_a_file(file)
    if why is not None:
        what = "no such file" if why == "does not exist" else f"{file!r} {why}"
        raise ValueError(
            f"tokenizer_path={path!r}: {what}; expected a HuggingFace tokenizers "
            "'tokenizer.json' file or a directory containing one."
        )
    try:
        return tokenizers.Tokenizer.from_file(file)
    except Exception as e:  # the Rust side raises a bare Exception for malformed files
        raise ValueError(
            f"tokenizer_path={path!r}: {file!r} is not a valid HuggingFace tokenizers "
            f"'tokenizer.json' ({type(e).__name__}: {e})."
        ) from e


def _first_present(tok: tokenizers.Tokenizer, candidates: tuple[str, ...]) -> int | None:
    for token in candidates:
        token_id = tok.token_to_id(token)
        if token_id is not None:
            return token_id
    return None


@dataclasses.dataclass(frozen=True)
class DocumentEncoder:
    """Turns one document's text into token ids framed as `[BOS] text [EOS]`.

    Attributes:
      tokenizer: the HuggingFace tokenizer.
      bos_id: prepended to every document; None when the tokenizer has no BOS token.
      eos_id: appended to every document; None when the tokenizer has no EOS token.
    """

    tokenizer: tokenizers.Tokenizer
    bos_id: int | None
    eos_id: int | None

    @classmethod
    def from_tokenizer(cls, tok: tokenizers.Tokenizer) -> DocumentEncoder:
        return cls(tok, _first_present(tok, BOS_CANDIDATES), _first_present(tok, EOS_CANDIDATES))

    def __call__(self, text: str) -> np.ndarray:
        """Returns the int32 ids of one document, shape [n]; n = 0 for empty text."""
        if not text:
            return np.zeros((0,), np.int32)
        try:
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        except Exception as e:  # the Rust side raises a bare Exception (a word it cannot map)
            raise ValueError(
                f"the tokenizer (tokenizer_path) cannot encode a document beginning {text[:40]!r} "
                f"({type(e).__name__}: {e}); give a tokenizer with an unknown token, or data it "
                "covers"
            ) from None
        if self.bos_id is not None:
            ids = [self.bos_id, *ids]
        if self.eos_id is not None:
            ids = [*ids, self.eos_id]
        return np.asarray(ids, np.int32)
