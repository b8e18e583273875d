"""Reading a user's files with one-line errors, and writing outputs so that a failure never leaves a
half-written one behind. `what` names the file in every message ("evaluation text", "report")."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path


def check_output_location(out: Path, what: str) -> None:
    """Fail in one line, before any work, when OUT (a file or directory) could not be written: a
    parent that is a file, a read-only or pseudo filesystem (/proc), no permission. Probes by
    creating and removing a directory in OUT's nearest existing ancestor, so nothing is left behind."""
    from quantship.errors import QuantshipError

    parent = Path(out).absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise QuantshipError(f"cannot write the {what}: {parent} is not a directory", out)
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".quantship-probe-", dir=parent))
    except OSError as exc:
        raise QuantshipError(f"cannot write the {what} in {parent} ({exc.strerror or exc})", out) from None


def file_mode() -> int:
    """0666 less the umask: what open() gives a new file. Temporary files (mkstemp) and some writers
    use 0600, which a container running as another user (the pods run as UID 10001) cannot read."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def sha256_file(path: Path) -> str:
    """The file's SHA-256, hex, read in 1 MiB chunks (weights files are larger than memory may hold)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_atomic(path: Path, data: str | bytes, what: str) -> Path:
    """Write via a temporary file in the same directory + os.replace: readers never see half a file, and a
    failure leaves none. The file gets open()'s usual mode (see file_mode), not mkstemp's 0600."""
    from quantship.errors import QuantshipError

    path = Path(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(tmp, file_mode())
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise QuantshipError(f"cannot write the {what} ({exc.strerror or exc})", path) from None
        raise
    return path


def publish_directory(tmp: Path, out: Path) -> None:
    """Swap a finished directory into place; an existing OUT goes only after the new one is there."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def load_yaml(text: str, all_documents: bool = False):
    """yaml.safe_load (or safe_load_all, as a list) through libyaml's parser where PyYAML was built with it:
    the same documents and error classes, parsed 8-10 times faster (tiny's 17 manifests: 6 ms against 63;
    deploy validate reads every manifest, and the dashboard's JSON in its ConfigMap once per HPA check)."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return list(yaml.load_all(text, Loader=loader)) if all_documents else yaml.load(text, Loader=loader)


def read_yaml_file(path: Path, what: str):
    """A user's YAML file (gates, rules), or a one-line QuantshipError naming the file and the problem."""
    import yaml

    from quantship.errors import QuantshipError

    try:
        return load_yaml(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise QuantshipError(f"cannot read the {what} ({getattr(exc, 'strerror', None) or exc})", path) from None
    except yaml.YAMLError as exc:
        raise QuantshipError(f"malformed YAML in the {what} ({' '.join(str(exc).split())})", path) from None


def read_text_file(path: Path, what: str) -> str:
    """A UTF-8 text file, or the "text" fields of a .jsonl file joined by blank lines (calibration and
    evaluation texts alike)."""
    import json

    from quantship.errors import QuantshipError

    path = Path(path)
    if path.is_dir():
        raise QuantshipError(f"{what} is a directory, not a file", path)
    if not path.is_file():
        raise QuantshipError(f"{what} not found", path)
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise QuantshipError(f"{what} is not UTF-8 text", path) from None
    except OSError as exc:  # no permission, a vanished file
        raise QuantshipError(f"cannot read the {what} ({exc.strerror})", path) from None
    if path.suffix == ".jsonl":
        texts = []
        for number, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise QuantshipError(f"line {number}: not JSON ({exc.msg})", path) from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise QuantshipError(f"line {number}: expected an object with a string 'text'", path)
            texts.append(record["text"])
        raw = "\n\n".join(texts)
    if not raw.strip():
        raise QuantshipError(f"{what} is empty", path)
    return raw
