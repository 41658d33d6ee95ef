import pytest

from tests.unit.convert.hub import write_checkpoints


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """A directory with hub/ (fp8) and deq/ (bfloat16) tiny DeepSeek-V3 checkpoints with one
    multi-token-prediction layer (tests/unit/convert/hub.py)."""
    return write_checkpoints(tmp_path_factory.mktemp("hub"))
