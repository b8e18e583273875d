import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from reference_models import CONFIGS, save_reference  # noqa: E402


@pytest.fixture(scope="session")
def reference_dirs(tmp_path_factory):
    """Every reference architecture saved once per session: name -> (directory, transformers model)."""
    out = {}
    for name in CONFIGS:
        d = tmp_path_factory.mktemp(name)
        out[name] = (d, save_reference(name, d))
    return out
