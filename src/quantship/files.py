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


def read_yaml_file(path: Path, what: str):
    """A user's YAML file (gates, rules), or a one-line QuantshipError naming the file and the problem."""
    import yaml

    from quantship.errors import QuantshipError

    try:
        return yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise QuantshipError(f"cannot read the {what} ({getattr(exc, 'strerror', None) or exc})", path) from None
    except yaml.YAMLError as exc:
        raise QuantshipError(f"malformed YAML in the {what} ({' '.join(str(exc).split())})", path) from None
