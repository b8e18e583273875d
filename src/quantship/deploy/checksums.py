"""SHA256SUMS over a model's weight and config files, and `deploy verify`: are these the bytes
that were deployed, and can this quantship serve them?

The file is in coreutils format ("<hex>  <path>"), so `sha256sum -c SHA256SUMS` run inside the
model directory checks it too. It sits next to quantship-manifest.json, which records the
checkpoint's format and writer, in the `deploy` output directory (or in the model directory).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from quantship import __version__
from quantship.deploy.model import checkpoint_identity, directory_files, model_files
from quantship.deploy.versions import compatible
from quantship.errors import QuantshipError
from quantship.files import sha256_file
from quantship.models.bundled import resolve_model

SUMS_FILE = "SHA256SUMS"
MANIFEST_FILE = "quantship-manifest.json"


def sums_text(model_dir: Path, files: list[str]) -> str:
    return "".join(f"{sha256_file(model_dir / name)}  {name}\n" for name in files)


def read_sums(path: Path) -> dict[str, str]:
    """{relative path: hex digest}; paths that would leave the model directory are refused."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise QuantshipError(f"cannot read checksums ({exc.strerror})", path) from None
    sums: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        digest, _, name = line.partition(" ")
        name = name[1:] if name[:1] in (" ", "*") else name  # "  text" or " *binary" mode
        rel = PurePosixPath(name)
        if len(digest) != 64 or not name or rel.is_absolute() or ".." in rel.parts:
            raise QuantshipError(f"line {number}: expected '<sha256>  <relative path>'", path)
        sums[name] = digest.lower()
    if not sums:
        raise QuantshipError("no checksums listed", path)
    return sums


@dataclass
class Verdict:
    ok: bool = True
    lines: list[str] = field(default_factory=list)
    strict: bool = False  # warnings fail too

    def fail(self, line: str) -> None:
        self.ok = False
        self.lines.append(f"FAIL {line}")

    def warn(self, line: str) -> None:
        if self.strict:
            return self.fail(line)
        self.lines.append(f"warn {line}")

    def note(self, line: str) -> None:
        self.lines.append(f"ok   {line}")


def _check_files(model_dir: Path, sums_path: Path, verdict: Verdict) -> None:
    listed = read_sums(sums_path)
    changed = [n for n, d in listed.items() if (model_dir / n).is_file() and sha256_file(model_dir / n) != d]
    missing = [n for n in listed if not (model_dir / n).is_file()]
    unlisted = [n for n in model_files(model_dir) if n not in listed]
    # Any other file may be harmless (a README), or something a loader picks up (a pickle): say so.
    extra = [n for n in directory_files(model_dir) if n not in listed and n not in unlisted]
    for name in changed:
        verdict.fail(f"{name}: SHA-256 differs from {sums_path}")
    for name in missing:
        verdict.fail(f"{name}: listed in {sums_path} but missing")
    for name in unlisted:
        verdict.fail(f"{name}: model file not listed in {sums_path}")
    for name in extra:
        verdict.warn(f"{name}: present but not listed in {sums_path}" + ("" if verdict.strict else " (--strict fails)"))
    if not (changed or missing or unlisted):
        verdict.note(f"{len(listed)} files match {sums_path}")


def _check_manifest(fmt: str, writer: str | None, manifest_path: Path, verdict: Verdict) -> None:
    try:
        recorded = json.loads(manifest_path.read_text(encoding="utf-8"))["checkpoint"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise QuantshipError(f"unreadable manifest ({exc})", manifest_path) from None
    for key, value in (("format", fmt), ("written_by", writer)):
        if recorded.get(key) != value:
            verdict.fail(f"checkpoint {key} is {value}, {manifest_path} recorded {recorded.get(key)}")
            return
    verdict.note(f"checkpoint format {fmt} as recorded in {manifest_path}")


def verify(model: str | Path, sums: str | Path | None = None, code_version: str = __version__,
           strict: bool = False) -> Verdict:
    model_dir = resolve_model(model)
    sums_path = Path(sums) if sums else model_dir / SUMS_FILE
    if sums_path.is_dir():
        sums_path = sums_path / SUMS_FILE
    if not sums_path.is_file():
        raise QuantshipError(f"no {SUMS_FILE} (write one with `quantship deploy MODEL -o DIR`, then --sums DIR)",
                             sums_path)
    fmt, writer = checkpoint_identity(model_dir)
    verdict = Verdict(strict=strict)
    _check_files(model_dir, sums_path, verdict)
    manifest_path = sums_path.parent / MANIFEST_FILE
    if manifest_path.is_file():
        _check_manifest(fmt, writer, manifest_path, verdict)
    ok, reason = compatible(code_version, writer, fmt)
    (verdict.note if ok else verdict.fail)(f"version: {reason}")
    return verdict
