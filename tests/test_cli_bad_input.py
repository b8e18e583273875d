"""Bad command lines as a careless or hostile user types them: each exits 2 with one line on stderr
(no usage block, no traceback), fails before any model is loaded, and leaves nothing behind. Then
the interrupt paths: SIGTERM cleans up like Ctrl-C, and outputs are readable by other users."""

import io
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from quantship.cli import main
from quantship.models.bundled import TINY_DIR
from quantship.models.loader import Checkpoint
from quantship.progress import progress_lines

UNWRITABLE = "/proc/quantship-test/out"  # a pseudo filesystem: nothing can be created there
PROM = "http://127.0.0.1:9"

# (command line with {tmp} for the test's directory, what the one line must mention)
CASES = [
    # numbers out of range, caught while parsing
    ("generate --prompt x --seed 18446744073709551616", "--seed: must be an integer in -9223372036854775808"),
    ("generate --prompt x --temperature nan", "--temperature: must be a finite number"),
    ("generate --prompt x --top-p 0", "--top-p"),
    ("generate --prompt x --max-tokens 0", "--max-tokens"),
    ("generate --prompt x --max-tokens 4000", "exceed the model's context of 2048 tokens"),
    ("generate", "the following arguments are required: --prompt"),
    ("generate --prompt x --bogus", "unrecognized arguments: --bogus"),
    ("quantize -o {tmp}/q --samples 0", "--samples"),
    ("quantize -o {tmp}/q --seq-len 99999", "--seq-len 99999 exceeds the model's context"),
    ("quantize -o {tmp}/q --dampening inf", "--dampening"),
    ("quantize -o {tmp}/q --method gptq --expert-hessian-gb 0", "--expert-hessian-gb"),
    ("quantize -o {tmp}/q --group-size 7", "--group-size"),
    ("export tiny --format gguf -o {tmp}/t.gguf --samples 0", "--samples"),
    ("verify tiny tiny --report {tmp}/r --ctx 0", "--ctx"),
    ("plan --budget-bits nan -o {tmp}/p.json", "--budget-bits"),
    ("serve --port 70000", "--port"),
    ("serve --block-size 0", "--block-size"),
    ("serve --request-timeout -1", "--request-timeout"),
    (f"bench {PROM} --profile constant --rate nan", "--rate"),
    (f"bench {PROM} --profile concurrent --concurrency 0", "--concurrency"),
    ("deploy tiny -o {tmp}/k --load-bandwidth nan", "--load-bandwidth"),
    ("deploy tiny -o {tmp}/k --gpus 9", "--gpus"),
    ("deploy tiny -o {tmp}/k --gpus 0 --replicas 1:99999999999", "--replicas 1:99999999999"),
    (f"gate canary --prometheus {PROM} --count 0", "--count"),
    (f"gate canary --prometheus {PROM} --interval inf", "--interval"),
    # values the library would only trip over later (a traceback, or a manifest the cluster refuses)
    ("quantize -o {tmp}/q --ignore re:([", "is not a valid regular expression"),
    ("deploy tiny -o {tmp}/k --gpus 0 --memory lots", "--memory 'lots' is not a positive Kubernetes quantity"),
    ("deploy tiny -o {tmp}/k --gpus 0 --cpu -3", "--cpu '-3'"),
    ("deploy tiny -o {tmp}/k --gpus 1 --gpu-type H100_80GB!", "is not a valid label value"),
    ("deploy tiny -o {tmp}/k --gpus 0 --prometheus-url prometheus:9090", "is not an http(s) URL"),
    ("serve --max-model-len 99999", "--max-model-len 99999 exceeds the model's context of 2048"),
    ("serve --api-key-file {tmp}/missing-key", "cannot read the API key"),
    ("plan --budget-bits 2 -o {tmp}/p.json", "is below the smallest plan"),
    ("plan --budget-bits 5 --schemes W9A16 -o {tmp}/p.json", "unknown scheme 'W9A16'"),
    ("quantize -o {tmp}/q --plan {tmp}/bad-scheme-plan.json", "model.layers.1.mlp.down_proj: unknown scheme 'W9A16'"),
    ("quantize -o {tmp}/q --plan {tmp}/other-model-plan.json", "names 1 module(s) this model does not have"),
    # outputs that cannot be written: refused before any work
    (f"quantize -o {UNWRITABLE}", "cannot write the output directory"),
    ("quantize -o {tmp}/a-file/q", "is not a directory"),
    (f"deploy tiny -o {UNWRITABLE} --gpus 0", "cannot write the output directory"),
    (f"verify tiny tiny --report {UNWRITABLE}", "cannot write the report"),
    (f"plan --budget-bits 5 -o {UNWRITABLE}/plan.json", "cannot write the plan"),
    (f"export tiny --format gguf -o {UNWRITABLE}.gguf", "cannot write the output"),
    (f"bench {PROM} -o {UNWRITABLE}", "cannot write the output"),
    # verify reads its inputs before minutes of evaluation
    ("verify tiny tiny --report {tmp}/r --gate {tmp}/missing.yaml", "cannot read the gates file"),
    ("verify tiny tiny --report {tmp}/r --gate {tmp}/unknown-metric.yaml", "unknown metric 'perplexity'"),
    ("verify tiny tiny --report {tmp}/r --text {tmp}/missing.txt", "evaluation text not found"),
    # a directory where a file belongs
    ("verify tiny tiny --report {tmp}/r --text {tmp}", "evaluation text is a directory, not a file"),
    ("quantize -o {tmp}/q --method gptq --calib {tmp}", "calibration file is a directory, not a file"),
    ("quantize -o {tmp}/q --plan {tmp}", "cannot read the plan file (Is a directory)"),
    ("verify tiny tiny --report {tmp}/r --ctx 512 --max-tokens 64", "less than one window of --ctx 512"),
    ("verify tiny tiny --report {tmp}/r --ctx 4096", "--ctx must be in 2..2048"),
    # checkpoints that only a load would have refused
    ("info {tmp}/truncated", "truncated safetensors file"),
    ("info {tmp}/unknown-dtype", "corrupt safetensors header"),  # a dtype safetensors does not know
    ("info {tmp}/wrong-shape", "corrupt safetensors header"),  # a shape its bytes do not hold
]


def _edit_header(shard: Path, edit) -> None:
    """Rewrite the first tensor's entry of a shard's header, keeping the file's length consistent."""
    raw = shard.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + length])
    edit(header[next(k for k in header if k != "__metadata__")])
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    shard.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length:])


def inputs(tmp: Path, case: str) -> None:
    (tmp / "a-file").write_text("not a directory")
    (tmp / "unknown-metric.yaml").write_text("gates:\n  - perplexity <= 10\n")
    for name, module, scheme in (("bad-scheme", "model.layers.1.mlp.down_proj", "W9A16"),
                                 ("other-model", "model.layers.99.mlp.down_proj", "W4A16")):
        (tmp / f"{name}-plan.json").write_text(json.dumps({"modules": {module: scheme}}))
    if "truncated" in case:
        shutil.copytree(TINY_DIR, tmp / "truncated")
        shard = tmp / "truncated" / "model-00002-of-00003.safetensors"
        os.truncate(shard, shard.stat().st_size // 2)  # an interrupted download
    for name, edit in (("unknown-dtype", lambda entry: entry.update(dtype="Q9")),
                       ("wrong-shape", lambda entry: entry.update(shape=[3, 3]))):
        if name in case:
            shutil.copytree(TINY_DIR, tmp / name)
            _edit_header(tmp / name / "model-00001-of-00003.safetensors", edit)


def tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*")}


@pytest.fixture
def no_model_loads(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the command line was refused")

    monkeypatch.setattr(Checkpoint, "load_model", refuse)
    monkeypatch.setattr(Checkpoint, "iter_layers", refuse)


@pytest.mark.parametrize("line,expected", CASES, ids=[c[0][:60] for c in CASES])
def test_a_bad_command_line_exits_2_in_one_line_and_writes_nothing(line, expected, tmp_path, capsys, no_model_loads):
    inputs(tmp_path, line)
    before = tree(tmp_path)
    assert main(line.format(tmp=tmp_path).split()) == 2
    out, err = capsys.readouterr()
    assert len(err.splitlines()) == 1 and err.startswith("quantship") and "Traceback" not in err, err
    assert expected in err, err
    assert out == ""
    assert tree(tmp_path) == before


def test_usage_errors_are_one_line_in_a_real_process_too():
    proc = subprocess.run([sys.executable, "-m", "quantship.cli", "generate", "--prompt", "x", "--seed", "1e3"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == ["quantship generate: error: argument --seed: expected an integer, got '1e3' "
                                        "(see quantship generate --help)"]


def test_sigterm_during_quantize_cleans_up_like_ctrl_c(tmp_path):
    """Stopped before its first layer is done: nothing is kept (later, finished layers are kept for --resume)."""
    out = tmp_path / "q"
    proc = subprocess.Popen([sys.executable, "-m", "quantship.cli", "quantize", "tiny", "-o", str(out), "--quiet",
                             "--method", "gptq"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not any(p.name.startswith(".q.partial") for p in tmp_path.iterdir()):  # the work has started
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)  # what `timeout`, a Kubernetes Job and systemd send
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and err.strip().endswith("terminated") and "Traceback" not in err, err
    left = list(tmp_path.iterdir())
    # Nothing is left behind, unless a busy machine let a layer finish first: then it is kept for
    # --resume, deliberately, and the message says so.
    assert left == [] or (len(left) == 1 and "--resume" in err), (left, err)


def test_quantized_files_follow_the_umask(tmp_path):
    previous = os.umask(0o022)
    try:
        assert main(["quantize", "-o", str(tmp_path / "q"), "--quiet", "--samples", "2", "--seq-len", "64"]) == 0
    finally:
        os.umask(previous)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "q").iterdir()}
    assert any(name.endswith(".safetensors") for name in modes)
    assert set(modes.values()) == {0o644}, modes  # safetensors alone would write 0600


def test_progress_is_printed_as_lines_when_not_on_a_terminal():
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=False)
    context, step = progress_lines(console, every_s=3600)
    with context:
        step("compare", 3)
        for _ in range(3):
            step()
    assert buffer.getvalue().splitlines() == ["compare: 0/3", "compare: 3/3"]


@pytest.mark.parametrize("error", [
    "CUDA out of memory. Tried to allocate 3.94 GiB. GPU 0 has a total capacity of 139.80 GiB",
    "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you tried to allocate 12 bytes",
])
def test_running_out_of_memory_is_one_line_that_says_what_needs_less(tmp_path, monkeypatch, capsys, error):
    """Out of memory on the GPU (torch's own error, or cuBLAS's RuntimeError) or on the host, in the
    middle of a command: one line naming what to lower, no traceback, nothing written."""
    import torch

    from quantship.quant import pipeline

    def quantize(*args, **kwargs):
        raise (torch.OutOfMemoryError if error.startswith("CUDA out") else RuntimeError)(error + "\nmore")

    monkeypatch.setattr(pipeline, "quantize", quantize)
    assert main(["quantize", "tiny", "-o", str(tmp_path / "q"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("quantship quantize: error: out of memory (")
    assert error[:40] in err and "--resume" in err and "--samples" in err and "Traceback" not in err
    assert not (tmp_path / "q").exists()


def test_other_runtime_errors_are_not_taken_for_out_of_memory(tmp_path, monkeypatch):
    from quantship.quant import pipeline

    def quantize(*args, **kwargs):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    monkeypatch.setattr(pipeline, "quantize", quantize)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):  # a bug stays a bug, with its traceback
        main(["quantize", "tiny", "-o", str(tmp_path / "q"), "--quiet"])


def _commands_with_device() -> list[str]:
    from quantship.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sorted(name for name, p in sub.choices.items()
                  if any("--device" in a.option_strings and "cuda" in (a.choices or ()) for a in p._actions))


REQUIRED = {"verify": ["tiny", "tiny", "--report", "{tmp}/r"], "plan": ["tiny", "--budget-bits", "5", "-o", "{tmp}/plan.json"],
            "quantize": ["tiny", "-o", "{tmp}/q"], "generate": ["--prompt", "x"], "serve": []}


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("command", _commands_with_device())
def test_device_cuda_without_a_gpu_is_one_line_before_anything_loads(command, tmp_path, capsys):
    args = [a.format(tmp=tmp_path) for a in REQUIRED[command]]  # a new command with --device must be listed
    assert main([command, *args, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no CUDA device is available" in err and "--device cpu" in err
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_is_one_line_and_quantize_keeps_its_layers_for_resume(tmp_path, monkeypatch, capsys):
    """ENOSPC in the middle of writing: one line (no traceback), and quantize's finished layers stay in
    its hidden partial directory for --resume, which then writes the whole checkpoint."""
    import errno

    from quantship.formats import compressed_tensors

    real_save = compressed_tensors.save_file
    calls = []

    def save_file(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(compressed_tensors, "save_file", save_file)
    out = tmp_path / "q"
    assert main(["quantize", "tiny", "-o", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("quantship quantize: error: no space left on device") and "--resume" in last
    assert "Traceback" not in err and not out.exists()
    assert main(["quantize", "tiny", "-o", str(out), "--quiet", "--resume"]) == 0
    assert (out / "config.json").is_file()


def test_other_os_errors_are_not_taken_for_a_full_disk(tmp_path, monkeypatch):
    import errno

    from quantship.formats import compressed_tensors

    def save_file(*args, **kwargs):
        raise OSError(errno.EBADF, "Bad file descriptor")

    monkeypatch.setattr(compressed_tensors, "save_file", save_file)
    with pytest.raises(OSError, match="Bad file descriptor"):
        main(["quantize", "tiny", "-o", str(tmp_path / "q"), "--quiet"])


def test_an_unchecked_path_error_is_one_line_naming_the_path(tmp_path, monkeypatch, capsys):
    """The net under readers that do not check their path: a missing file, a directory where a file
    belongs or no permission is one line naming the path; a bug's OSError without a path still raises."""
    import errno

    from quantship.quant import pipeline

    def quantize(*args, **kwargs):
        raise IsADirectoryError(errno.EISDIR, "Is a directory", str(tmp_path))

    monkeypatch.setattr(pipeline, "quantize", quantize)
    assert main(["quantize", "tiny", "-o", str(tmp_path / "q"), "--quiet"]) == 2
    assert capsys.readouterr().err == f"quantship quantize: error: {tmp_path}: is a directory\n"

    def no_path(*args, **kwargs):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory")

    monkeypatch.setattr(pipeline, "quantize", no_path)
    with pytest.raises(FileNotFoundError):
        main(["quantize", "tiny", "-o", str(tmp_path / "q"), "--quiet"])


@pytest.mark.parametrize("sig, code, word", [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")])
def test_a_signal_that_native_code_turns_into_its_own_error_is_still_a_stop(sig, code, word, tmp_path, monkeypatch,
                                                                             capsys):
    """The handler's exception, raised while torch builds a tensor for safetensors, can come out as torch's
    own error (CI saw "could not determine the shape of object type 'torch.storage.UntypedStorage'"), which
    the loader reports as an unreadable tensor. It is still a stop, not bad input: the signal's exit code,
    and the finished layers kept for --resume."""
    from quantship.errors import QuantshipError

    real_read = Checkpoint.read

    def read(self, names):
        if any(".layers.1." in name for name in names):  # layer 0 is finished by now
            try:
                signal.raise_signal(sig)
            except KeyboardInterrupt:
                raise QuantshipError("cannot read tensor (could not determine the shape of object type)",
                                     "shard") from None
        return real_read(self, names)

    monkeypatch.setattr(Checkpoint, "read", read)
    out = tmp_path / "q"
    assert main(["quantize", "tiny", "-o", str(out), "--quiet"]) == code
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == word and "error" not in err and "--resume" in err, err
    assert not out.exists() and (tmp_path / ".q.partial").is_dir()
    monkeypatch.setattr(Checkpoint, "read", real_read)
    assert main(["quantize", "tiny", "-o", str(out), "--quiet", "--resume"]) == 0
    assert (out / "config.json").is_file()


def test_a_signal_whose_exception_native_code_swallowed_stops_quantize_at_the_next_layer(tmp_path, monkeypatch,
                                                                                           capsys):
    """Native code may also drop the handler's exception and carry on: the recorded signal stops the run at
    the next layer, with the finished layers kept for --resume."""
    real_read = Checkpoint.read

    def read(self, names):
        if any(".layers.1." in name for name in names):
            try:
                signal.raise_signal(signal.SIGTERM)
            except KeyboardInterrupt:
                pass  # swallowed
        return real_read(self, names)

    monkeypatch.setattr(Checkpoint, "read", read)
    out = tmp_path / "q"
    assert main(["quantize", "tiny", "-o", str(out), "--quiet"]) == 143
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "terminated" and "2 of" in err and "--resume" in err, err
    assert not out.exists() and (tmp_path / ".q.partial").is_dir()
