"""Resumable quantize runs: what a run keeps in its hidden temporary directory, and how it goes on.

After every decoder layer (with large activations, as often as costs a tenth of the run's time) the
run records, in `.OUT.partial/resume/`, where it stands: the next layer, the shards already written,
the tensors not yet flushed to a shard, the calibration activations the next layer reads, and the
recipe's running tallies. The record is replaced atomically (a new state.json names its files; older
files go only after), so a run killed at any moment leaves the previous record intact. `--resume`
restores it and continues from the first layer after it; since the shard writer and the activations
are restored exactly, the output is byte for byte what an uninterrupted run writes. A changed setting
is refused, naming it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from quantship.errors import QuantshipError

STATE_DIR = "resume"
LOCK_FILE = ".lock"
RECORD_SHARE = 0.1  # of the time since the last record, at most this is spent writing the next one
ALWAYS_RECORD_BYTES = 256 << 20  # activations this small are recorded after every layer
# A large record never leaves less free disk than this: the output's shards, still to be written, come
# first. (At DeepSeek-V3's width one record of 512 x 2048 calibration tokens is 30 GB, and the old record
# goes only after the new one is complete.)
RECORD_DISK_RESERVE = 8 << 30


def source_fingerprint(model_dir: Path, files: list[Path]) -> str:
    """config.json's bytes and each weight file's name, size and modification time: a changed source is noticed
    without hashing terabytes."""
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for f in sorted(set(files)):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def _write_activations(hidden: torch.Tensor, path: Path) -> None:
    hidden.detach().float().cpu().contiguous().numpy().tofile(path)


class ResumableRun:
    """The temporary directory of one quantize run, held under a lock for as long as the run lasts."""

    def __init__(self, tmp: Path, settings: dict, resume: bool):
        self.tmp, self.settings = tmp, settings
        self.state_dir = tmp / STATE_DIR
        self.state: dict | None = None
        self._lock = None
        self._last: tuple[float, float] | None = None  # when the last record ended, and what it cost (s)
        self._skipping = False  # the last record was skipped (the disk): said once, not after every layer
        if resume and not (self.state_dir / "state.json").is_file():
            raise QuantshipError("--resume: no interrupted run of this output to continue", tmp)
        tmp.mkdir(exist_ok=True)
        self._take_lock()
        if resume:
            self.state = json.loads((self.state_dir / "state.json").read_text())
            self._check_settings()
        else:
            self._clear()  # an earlier run's leftovers: this run starts over
        self.resumed_from = self.state["next_layer"] if self.state else None

    def _take_lock(self) -> None:
        self._lock = open(self.tmp / LOCK_FILE, "a+")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise QuantshipError("another quantize is writing this output right now", self.tmp) from None

    def _clear(self) -> None:
        for entry in self.tmp.iterdir():
            if entry.name != LOCK_FILE:
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()

    def _check_settings(self) -> None:
        before = self.state["settings"]
        changed = [k for k in sorted(set(before) | set(self.settings)) if before.get(k) != self.settings.get(k)]
        if changed:
            k = changed[0]
            raise QuantshipError(f"--resume refused: {k} was {before.get(k)!r} in the interrupted run, now "
                                 f"{self.settings.get(k)!r} (run without --resume to start over)", self.tmp)

    @property
    def next_layer(self) -> int:
        return self.state["next_layer"] if self.state else 0

    def restore(self, writer) -> tuple[torch.Tensor | None, dict]:
        """Put the shard writer back where it was; returns the saved activations and tallies."""
        s = self.state
        writer.shards = [(self.tmp / name, names) for name, names in s["shards"]]
        writer.total = s["total"]
        kept = {name for name, _ in s["shards"]}
        for stray in self.tmp.glob("shard-*.tmp"):  # flushed after the last record: written again
            if stray.name not in kept:
                stray.unlink()
        writer.pending = load_file(self.state_dir / s["pending"]) if s["pending"] else {}
        writer.pending_bytes = sum(t.numel() * t.element_size() for t in writer.pending.values())
        hidden = None
        if s["hidden"]:
            shape = s["hidden"]["shape"]
            hidden = torch.from_numpy(np.fromfile(self.state_dir / s["hidden"]["file"], dtype=np.float32)).view(shape)
        return hidden, s["tallies"]

    def record(self, next_layer: int, writer, hidden: torch.Tensor | None, tallies: dict) -> None:
        """Called after each finished layer (its tensors handed to the writer, `hidden` its output). Large
        activations are written only while that costs at most RECORD_SHARE of the run's time: at DeepSeek-V3's
        width, 512 x 2048 calibration tokens are 30 GB per record. A layer without a record is redone by
        --resume (the shards written since the last record are dropped, as they are after any kill)."""
        size = 0 if hidden is None else hidden.numel() * 4
        now = time.monotonic()
        if size > ALWAYS_RECORD_BYTES:
            if self._last is not None and (now - self._last[0]) * RECORD_SHARE < self._last[1]:
                return
            # The record only saves time after a crash: a disk too small for it skips it, and the run goes on
            # (a small record is always written; should the disk be full, the OSError below drops it).
            needed = size + writer.pending_bytes + RECORD_DISK_RESERVE
            free = shutil.disk_usage(self.tmp).free
            if free < needed:
                self._skipped(next_layer, f"it needs {needed / 2**30:.1f} GiB of free disk (with "
                                          f"{RECORD_DISK_RESERVE / 2**30:.0f} GiB kept for the output), "
                                          f"{free / 2**30:.1f} GiB are free")
                return
        try:
            self._record(next_layer, writer, hidden, tallies)
        except OSError as exc:  # the disk filled up after all, or it failed: keep the last complete record
            self._drop_unnamed()
            self._skipped(next_layer, f"writing it failed: {exc.strerror or exc}")
            return
        self._last = (time.monotonic(), time.monotonic() - now)  # (when the last record ended, its cost)
        self._skipping = False

    def _skipped(self, next_layer: int, why: str) -> None:
        """Said once when records stop; again only after one succeeded in between."""
        if not self._skipping:
            print(f"quantize: no resume record after layer {next_layer - 1}: {why}; the run goes on, and skips "
                  f"records while this lasts (--resume after a crash would start from layer {self.next_layer})",
                  file=sys.stderr)
        self._skipping = True

    def _drop_unnamed(self) -> None:
        """Delete what the current state.json does not name (a new record's files, or a half-written one)."""
        named = {"state.json"}
        if self.state is not None:
            named |= {self.state["pending"], self.state["hidden"] and self.state["hidden"]["file"]}
        if self.state_dir.is_dir():
            for entry in self.state_dir.iterdir():
                if entry.name not in named:
                    entry.unlink()

    def _record(self, next_layer: int, writer, hidden: torch.Tensor | None, tallies: dict) -> None:
        self.state_dir.mkdir(exist_ok=True)
        pending = None
        if writer.pending:
            pending = f"pending-{next_layer}.safetensors"
            save_file(writer.pending, str(self.state_dir / pending))
        saved_hidden = None
        if hidden is not None:
            name = f"hidden-{next_layer}.f32"
            _write_activations(hidden, self.state_dir / name)
            saved_hidden = {"file": name, "shape": list(hidden.shape)}
        state = {"settings": self.settings, "next_layer": next_layer, "total": writer.total,
                 "shards": [(path.name, names) for path, names in writer.shards], "pending": pending,
                 "hidden": saved_hidden, "tallies": tallies}
        tmp_state = self.state_dir / "state.json.tmp"
        with open(tmp_state, "w") as f:
            json.dump(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_state, self.state_dir / "state.json")
        self.state = state
        self._drop_unnamed()  # the previous record's files

    def finish(self) -> None:
        """Before the directory is published: drop the resume record and the lock."""
        shutil.rmtree(self.state_dir, ignore_errors=True)
        self.release()
        (self.tmp / LOCK_FILE).unlink(missing_ok=True)

    def release(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None
