"""Writing outputs so that a failure never leaves a half-written one behind."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def publish_directory(tmp: Path, out: Path) -> None:
    """Swap a finished directory into place; an existing OUT goes only after the new one is there."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
