"""Quantizing on several devices: one process per device, each layer's GPTQ work split between them.

Started by torchrun, which sets RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous address:

    torchrun --nproc-per-node 2 -m quantship quantize MODEL OUT --method gptq --device cuda

Every process streams the same layer and runs the calibration forward passes (cheap next to GPTQ on
a MoE layer); the Linears to solve (the routed experts are most of them) are dealt round-robin in a
fixed order, each process solves its share, and every result is broadcast from its solver, so all
processes hold the same quantized layer and compute the same inputs for the next one. Only rank 0
writes. GPTQ treats each Linear on its own (a batch only shares the column loop), so the
checkpoint is byte-identical to a one-device run with the same settings. Processes talk through
torch.distributed: NCCL between GPUs, gloo on CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from quantship.errors import QuantshipError
from quantship.quantized_tensor import QuantizedTensor


@dataclass
class Workers:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def writes(self) -> bool:
        return self.rank == 0

    def mine(self, names: list[str]) -> list[str]:
        """This process's share of `names` (all of them when alone)."""
        return [n for i, n in enumerate(names) if i % self.world == self.rank]

    def share(self, solved: dict[str, QuantizedTensor], names: list[str], template: dict[str, QuantizedTensor]
              ) -> dict[str, QuantizedTensor]:
        """Every process's results for `names`, each broadcast by its solver. `template` gives each
        name's quantization args (the same on every process)."""
        if self.world == 1:
            return solved
        out = {}
        for i, name in enumerate(names):
            src = i % self.world
            mine = solved.get(name) if src == self.rank else None
            tensors = [_broadcast(None if mine is None else getattr(mine, f), src, self) for f in _FIELDS]
            out[name] = QuantizedTensor(*tensors[:3], template[name].args, tensors[3])
        return out

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


_FIELDS = ("values", "scale", "zero_point", "g_idx")
_DTYPES = [torch.int8, torch.uint8, torch.int32, torch.int64, torch.float32, torch.bfloat16, torch.float16,
           torch.float8_e4m3fn]


def from_environment(device: str) -> Workers:
    """The process group torchrun describes in the environment, or a group of one."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Workers(device=torch.device(device))
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    where = torch.device(device)
    if where.type == "cuda":
        if torch.cuda.device_count() <= local:
            raise QuantshipError(f"process {rank} of {world} wants GPU {local}, but {torch.cuda.device_count()} "
                                 "are visible")
        where = torch.device("cuda", local)
        torch.cuda.set_device(where)
    dist.init_process_group("nccl" if where.type == "cuda" else "gloo", rank=rank, world_size=world)
    return Workers(rank, world, where)


def _broadcast(t: torch.Tensor | None, src: int, workers: Workers) -> torch.Tensor | None:
    """`t` from process `src` to all (None stays None): a header with its dtype and shape, then its
    bytes (as uint8, which every backend carries whatever the dtype)."""
    link = workers.device if workers.device.type == "cuda" else torch.device("cpu")
    header = torch.full((10,), -1, dtype=torch.int64, device=link)
    if workers.rank == src and t is not None:
        header[0], header[1] = _DTYPES.index(t.dtype), t.dim()
        header[2:2 + t.dim()] = torch.tensor(t.shape)
    dist.broadcast(header, src)
    code, ndim, *dims = header.tolist()
    if code < 0:
        return None
    dtype, shape = _DTYPES[code], dims[:ndim]
    if workers.rank == src:
        data = t.detach().to(link).contiguous().reshape(-1).view(torch.uint8)
    else:
        data = torch.empty(int(torch.tensor(shape).prod()) * dtype.itemsize, dtype=torch.uint8, device=link)
    dist.broadcast(data, src)
    return data.view(dtype).reshape(shape).to(workers.device)


class DiscardingWriter:
    """The shard writer of a process that does not write (rank > 0)."""

    def add(self, name: str, tensor: torch.Tensor) -> None:
        pass

    def end_of_layer(self) -> None:
        pass


class UnrecordedRun:
    """The resumable-run record of a process that does not write: it starts at layer 0 and keeps nothing."""

    state = None
    next_layer = 0

    def record(self, next_layer: int, writer, hidden, tallies: dict) -> None:
        pass
