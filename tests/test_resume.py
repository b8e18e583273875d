"""Resumable quantize runs: an interrupted run keeps its finished layers, --resume continues with the
same settings, and the output is byte for byte what an uninterrupted run writes."""

import json
import os
import signal
import subprocess
import sys
import time
from collections import namedtuple
from types import SimpleNamespace

import pytest

from quantship.cli import main
from quantship.errors import QuantshipError
from quantship.quant import pipeline
from quantship.quant.pipeline import QuantizeOptions, quantize

GPTQ = dict(method="gptq", samples=4, seq_len=64)
VARYING = ("seconds", "resumed_from_layer")  # the recipe's timing differs between any two runs


def _same_output(a, b, varying=VARYING):
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    for name in files:
        if name == "quantship_recipe.json":
            ra, rb = (json.loads((d / name).read_text()) for d in (a, b))
            same = {k: v for k, v in ra.items() if k not in varying}
            assert same == {k: v for k, v in rb.items() if k not in varying}
        else:
            assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    out = tmp_path_factory.mktemp("clean") / "q"
    quantize("tiny", out, QuantizeOptions(**GPTQ))
    return out


def _interrupt_after(monkeypatch, layers: int):
    """Ctrl-C while the layer after `layers` finished ones is being run."""
    calls = {"n": 0}
    real = pipeline._run

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == layers + 1:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "_run", interrupted)


def test_interrupted_then_resumed_equals_uninterrupted(clean, tmp_path, monkeypatch, capsys):
    out = tmp_path / "q"
    _interrupt_after(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        quantize("tiny", out, QuantizeOptions(**GPTQ))
    partial = tmp_path / ".q.partial"
    assert not out.exists() and partial.is_dir()
    assert not (partial / "config.json").exists()  # nothing there looks like a finished checkpoint
    assert json.loads((partial / "resume" / "state.json").read_text())["next_layer"] == 3
    assert "3 of 8 layers are kept" in capsys.readouterr().err
    monkeypatch.undo()
    steps = []
    # A changed Hessian budget (here: one expert a pass) only changes how many passes gather the statistics.
    recipe = quantize("tiny", out, QuantizeOptions(**GPTQ, resume=True, expert_hessian_gb=1e-4),
                      progress=lambda *a: steps.append(a))
    assert recipe["resumed_from_layer"] == 3 and not partial.exists()
    assert steps == [("quantize", 8, 3)] + [()] * 5  # the progress callback starts at the resumed layer
    assert recipe["memory"]["expert_groups"] == 8  # the recipe says how the finishing run gathered them
    _same_output(clean, out, VARYING + ("memory",))


def test_a_changed_setting_is_refused_with_its_name(tmp_path, monkeypatch, capsys):
    out = tmp_path / "q"
    _interrupt_after(monkeypatch, 1)
    with pytest.raises(KeyboardInterrupt):
        quantize("tiny", out, QuantizeOptions(**GPTQ))
    monkeypatch.undo()
    with pytest.raises(QuantshipError, match="--resume refused: dampening was 0.01 in the interrupted run, now 0.05"):
        quantize("tiny", out, QuantizeOptions(**GPTQ, dampening=0.05, resume=True))
    capsys.readouterr()
    assert main(["quantize", "-o", str(out), "--method", "awq", "--samples", "4", "--seq-len", "64", "--resume",
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "method was 'gptq' in the interrupted run, now 'awq'" in err and len(err.strip().splitlines()) == 1
    assert (tmp_path / ".q.partial" / "resume" / "state.json").is_file()  # a refusal keeps what was kept
    # Without --resume the same output starts over.
    quantize("tiny", out, QuantizeOptions(samples=4, seq_len=64))
    assert out.is_dir() and not (tmp_path / ".q.partial").exists()


def test_resume_with_nothing_to_resume(tmp_path, capsys):
    assert main(["quantize", "-o", str(tmp_path / "q"), "--resume", "--quiet"]) == 2
    assert "no interrupted run of this output to continue" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_killed_process_resumes_to_the_same_bytes(clean, tmp_path):
    """SIGKILL runs no cleanup at all: what the last finished layer recorded must be enough."""
    out = tmp_path / "q"
    command = [sys.executable, "-m", "quantship.cli", "quantize", "-o", str(out), "--method", "gptq",
               "--samples", "4", "--seq-len", "64", "--quiet"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state = tmp_path / ".q.partial" / "resume" / "state.json"
    deadline = time.time() + 600
    while time.time() < deadline and process.poll() is None:
        if state.is_file() and json.loads(state.read_text())["next_layer"] >= 2:
            break
        time.sleep(0.05)
    assert process.poll() is None, "the run ended before it could be killed"
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert not out.exists()
    recipe = quantize("tiny", out, QuantizeOptions(**GPTQ, resume=True))
    assert recipe["resumed_from_layer"] >= 2
    _same_output(clean, out)


def test_rtn_runs_no_calibration_pass(tmp_path, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("RTN ran a calibration forward pass")

    monkeypatch.setattr(pipeline, "_run", forbidden)
    monkeypatch.setattr(pipeline, "collect_stats", forbidden)
    recipe = quantize("tiny", tmp_path / "q", QuantizeOptions(samples=4, seq_len=64))
    assert recipe["calibration"] == {} and recipe["tokens_per_expert"] == {}


def test_large_activations_are_recorded_only_as_often_as_a_tenth_of_the_time(tmp_path, monkeypatch):
    """A record of DeepSeek-V3-sized activations costs a minute: it is skipped until the time since the
    last one is ten times what that one cost; small ones are recorded after every layer."""
    import torch

    from quantship.quant import resume as R

    clock = [100.0]
    monkeypatch.setattr(R.time, "monotonic", lambda: clock[0])
    written = []

    def slow_record(self, next_layer, writer, hidden, tallies):
        written.append(next_layer)
        clock[0] += 60.0  # writing 30 GB

    monkeypatch.setattr(R.ResumableRun, "_record", slow_record)
    run = R.ResumableRun(tmp_path / "partial", {}, resume=False)
    large = torch.empty(1).expand(R.ALWAYS_RECORD_BYTES // 4 + 1)  # counted by size, never allocated
    writer = SimpleNamespace(pending_bytes=0)
    for layer in range(1, 9):
        clock[0] += 150.0  # a layer's work
        run.record(layer, writer, large, {})
    # 60 s records need 600 s of work between them: after layers 1, 5 (4 x 150 s later) and then 9.
    assert written == [1, 5]
    small = torch.zeros(4)
    for layer in range(9, 12):
        clock[0] += 1.0
        run.record(layer, writer, small, {})
    assert written == [1, 5, 9, 10, 11]
    run.release()


def test_a_disk_too_small_for_the_record_skips_it_and_the_run_goes_on(clean, tmp_path, monkeypatch, capsys):
    """At DeepSeek-V3's width a record is 30 GB: on a disk that cannot hold it (and the output still to come)
    the run must not fill the disk; it says so once and writes the same model. Small records are written
    whatever the disk says (a full disk is the next test's case)."""
    from quantship.quant import resume as R

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(R.shutil, "disk_usage", lambda path: usage(10 << 30, 10 << 30, R.RECORD_DISK_RESERVE - 1))
    monkeypatch.setattr(R, "ALWAYS_RECORD_BYTES", 0)  # the tiny model's activations stand for V3's 30 GB
    out = tmp_path / "q"
    quantize("tiny", out, QuantizeOptions(**GPTQ))
    _same_output(clean, out)
    err = capsys.readouterr().err
    assert err.count("no resume record") == 1 and "after layer 0" in err and "GiB are free" in err, err


def test_a_record_that_fails_to_write_keeps_the_last_complete_one(clean, tmp_path, monkeypatch, capsys):
    """The disk fills up while the activations of layer 3 are written: the half-written file goes, the run
    goes on (and is stopped later), and --resume continues from the last complete record."""
    from quantship.quant import resume as R

    real, calls = R._write_activations, {"n": 0}

    def fills_up(hidden, path):
        calls["n"] += 1
        if calls["n"] == 3:
            path.write_bytes(b"partial")
            raise OSError(28, "No space left on device")
        real(hidden, path)

    monkeypatch.setattr(R, "_write_activations", fills_up)
    _interrupt_after(monkeypatch, 3)
    out = tmp_path / "q"
    with pytest.raises(KeyboardInterrupt):
        quantize("tiny", out, QuantizeOptions(**GPTQ))
    err = capsys.readouterr().err
    assert "no resume record after layer 2: writing it failed: No space left on device" in err, err
    state_dir = tmp_path / ".q.partial" / "resume"
    state = json.loads((state_dir / "state.json").read_text())
    assert state["next_layer"] == 2
    named = {"state.json", state["pending"], state["hidden"]["file"]} - {None}
    assert {p.name for p in state_dir.iterdir()} == named
    monkeypatch.undo()
    recipe = quantize("tiny", out, QuantizeOptions(**GPTQ, resume=True))
    assert recipe["resumed_from_layer"] == 2
    _same_output(clean, out)
