"""A decode step run ahead: launched, its tokens sampled on the device and on their way to the host,
not yet read. The engine launches the next decode step (which takes these tokens on the device) before
it reads them, so the GPU never waits through the host's bookkeeping between two steps."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantship.engine.sampler import read_tokens
from quantship.engine.sequence import Sequence

PENDING = -1  # the token a sequence holds while its real one is still in flight (never fed to the model)


def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    """A host copy that does not wait: pinned memory and a non-blocking copy on CUDA."""
    if t is None or not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


@dataclass
class InFlight:
    seqs: list[Sequence]  # in the order of the step's rows
    tokens: torch.Tensor  # [S] on the device: what the next step's graph reads
    host_tokens: torch.Tensor
    host_logprobs: torch.Tensor | None
    want_logprobs: list[bool]
    done: torch.cuda.Event | None  # recorded after the copies: read() waits for this step only

    @classmethod
    def start(cls, seqs: list[Sequence], tokens: torch.Tensor, logprobs: torch.Tensor | None,
              want_logprobs: list[bool]) -> InFlight:
        host_tokens, host_logprobs = _to_host(tokens), _to_host(logprobs)
        done = None
        if tokens.is_cuda:
            done = torch.cuda.Event()
            done.record()
        return cls(seqs, tokens, host_tokens, host_logprobs, want_logprobs, done)

    def read(self) -> tuple[list[int], list[float | None]]:
        """The tokens and log-probabilities, once this step's copies have landed (later launches are not
        waited for)."""
        if self.done is not None:
            self.done.synchronize()
        return read_tokens(self.host_tokens, self.host_logprobs, self.want_logprobs)
