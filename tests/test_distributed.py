"""GPTQ split across two processes (torch.distributed with gloo, as torchrun starts them) writes the
very checkpoint one process writes: every tensor file byte for byte, and the same config."""

import json
import os
import socket
import subprocess
import sys

import torch
from safetensors.torch import load_file

ARGS = ["quantize", "tiny", "-o", None, "--method", "gptq", "--samples", "8", "--seq-len", "64", "--quiet"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _quantize(out, world: int) -> list[subprocess.CompletedProcess]:
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, OMP_NUM_THREADS="1")
        if world > 1:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
        args = [a if a is not None else str(out) for a in ARGS]
        procs.append(subprocess.Popen([sys.executable, "-m", "quantship", *args], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=900), *p.communicate()) for p in procs]


def test_two_processes_write_what_one_writes(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    [alone] = _quantize(one, 1)
    assert alone.returncode == 0, alone.stderr[-2000:]
    ranks = _quantize(two, 2)
    assert [r.returncode for r in ranks] == [0, 0], [r.stderr[-2000:] for r in ranks]
    assert "wrote" in ranks[0].stdout and ranks[1].stdout == ""  # only rank 0 writes and reports
    shards = sorted(p.name for p in one.glob("*.safetensors"))
    assert shards and shards == sorted(p.name for p in two.glob("*.safetensors"))
    for name in shards:
        a, b = load_file(one / name), load_file(two / name)
        assert a.keys() == b.keys()
        different = [k for k in a if not (a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                                          and a[k].view(-1).view(torch.uint8).equal(b[k].view(-1).view(torch.uint8)))]
        assert not different, different[:5]
    assert (one / "config.json").read_text() == (two / "config.json").read_text()
    recipe = json.loads((two / "quantship_recipe.json").read_text())
    assert recipe["method"] == "gptq" and recipe["fallbacks"] == json.loads(
        (one / "quantship_recipe.json").read_text())["fallbacks"]
