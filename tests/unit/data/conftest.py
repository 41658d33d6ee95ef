"""Fixtures for the data tests: one tiny corpus per session (tiny_corpus.py)."""

import pytest
from tiny_corpus import Corpus


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Corpus:
    return Corpus(tmp_path_factory.mktemp("corpus"))
