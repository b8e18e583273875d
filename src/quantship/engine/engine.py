"""LLMEngine: add requests, step the batch, collect outputs. Not thread-safe: AsyncEngine serialises it."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quantship.engine import memory
from quantship.engine.block_manager import BlockManager
from quantship.engine.config import EngineConfig
from quantship.engine.inflight import PENDING, InFlight
from quantship.engine.model_runner import ModelRunner
from quantship.engine.sampler import draw_tokens, read_tokens
from quantship.engine.sampling_params import SamplingParams
from quantship.engine.scheduler import QueueFull, Scheduler
from quantship.engine.sequence import RequestMetrics, Sequence, Status
from quantship.engine.text import TextTracker
from quantship.models.causal_lm import CausalLM
from quantship.models.paged import kv_bytes_per_token
from quantship.models.quantized import weight_bytes

__all__ = ["EngineStats", "LLMEngine", "QueueFull", "RequestOutput", "load_engine"]


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    text: str = ""  # new text since the last output (stop strings cut)
    logprobs: list[float] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # stop, length, abort, timeout, error
    prompt_tokens: int = 0
    completion_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None

    @classmethod
    def failure(cls, request_id: str, message: str) -> RequestOutput:
        return cls(request_id, finished=True, finish_reason="error", error=message)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    num_blocks: int
    block_size: int
    kv_bytes_per_token: int


class LLMEngine:
    def __init__(self, model: CausalLM, config: EngineConfig | None = None, tokenizer=None,
                 eos_ids: set[int] | None = None):
        self.config = config = config or EngineConfig()
        config.validate()
        self.model, self.tokenizer = model, tokenizer
        self.eos_ids = set(eos_ids or ())
        mc = model.config
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        dtype = model.model.embed_tokens.weight.dtype
        self.kv_bytes_per_token = kv_bytes_per_token(mc, dtype)
        memory.prefer_expandable_segments(model.model.embed_tokens.weight.device)  # a model loaded elsewhere
        num_blocks = config.num_blocks or self._default_blocks(config, self.kv_bytes_per_token)
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.blocks)
        self.runner = ModelRunner(model, num_blocks, config.block_size, config.cuda_graphs, config.max_num_seqs,
                                  self.max_model_len, config.expert_stats, config.prefill_graphs)
        self.sequences: dict[str, Sequence] = {}
        self.texts: dict[str, TextTracker] = {}
        self.prompt_tokens = self.generation_tokens = 0
        self.first_token_at: float | None = None  # monotonic time of the first token generated (cold start)
        self._pending: list[RequestOutput] = []  # outputs produced outside step (aborts, timeouts)
        self._ahead: InFlight | None = None  # the decode step whose tokens are not read yet (run_ahead)

    def _default_blocks(self, config: EngineConfig, per_token: int) -> int:
        device = self.model.model.embed_tokens.weight.device
        budget = config.kv_cache_bytes
        if budget is None:
            free = memory.free_after_weights(config.memory_bytes, weight_bytes(self.model), device)
            budget = memory.CPU_KV_CACHE_BYTES if free is None else memory.kv_cache_budget(free, config.kv_cache_fraction)
        return memory.cache_blocks(budget, per_token, config.block_size, config.max_num_seqs, self.max_model_len)

    def warm_up(self, prompt_tokens: int = 16, new_tokens: int = 2) -> None:
        """One short request through prefill and decode before serving, so lazy initialisations (kernel
        compilation, cuBLAS handles, int4 decode copies) are not paid by a client's first token. Leaves
        no trace: token and prefix-cache counters, the prefix cache and first_token_at are reset."""
        new_tokens = max(1, min(new_tokens, self.max_model_len - 1))
        length = max(1, min(prompt_tokens, self.max_model_len - new_tokens, self.blocks.num_blocks * self.blocks.block_size - 1))
        ids = [3 + i % max(1, self.model.config.vocab_size - 3) for i in range(length)]
        self.add_request("__warmup__", ids, SamplingParams(max_tokens=new_tokens, ignore_eos=True), bounded=False)
        while self.has_unfinished():
            self.step()
        self.prompt_tokens = self.generation_tokens = self.scheduler.num_preemptions = 0
        self.first_token_at = None
        self.blocks.reset_prefix_cache()

    # --- requests ---------------------------------------------------------------------------------
    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError, worded for an API client, if the request can never run. Reads no
        mutable state, so a server may call it from another thread."""
        params.validate()
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; this model's context is "
                             f"{self.max_model_len} tokens, and at least one must be left to generate")
        vocab = self.model.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        capacity = self.blocks.num_blocks * self.blocks.block_size
        if len(prompt_ids) + 1 > capacity:
            raise ValueError(f"the prompt needs more KV cache ({len(prompt_ids)} tokens) than the engine has "
                             f"({capacity} tokens)")

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    priority: int = 0, deadline: float | None = None, bounded: bool = True,
                    arrival: float | None = None) -> Sequence:
        """Queue a request; QueueFull when the waiting queue is at its bound (unless bounded=False,
        for a caller that enforced the bound itself)."""
        self.check_request(prompt_ids, params)
        if request_id in self.sequences:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, prompt_ids, params, priority, deadline, arrival)
        self.scheduler.add(seq, bounded)
        self.sequences[request_id] = seq
        if self.tokenizer is not None:
            self.texts[request_id] = TextTracker(self.tokenizer, params.stop)
        return seq

    def abort(self, request_id: str) -> None:
        seq = self.sequences.get(request_id)
        if seq is not None:
            self._finish(seq, "abort")
            self._pending.append(self._output(seq, []))

    def drop_all(self) -> list[str]:
        """End every unfinished request at once, with no output (the caller answers them): their blocks
        are freed. After a step that raised, this brings the engine back to a consistent empty state."""
        dropped = list(self.sequences)
        for seq in list(self.sequences.values()):
            self._finish(seq, "abort")
        self.texts.clear()
        self._pending, self._ahead = [], None
        return dropped

    def has_unfinished(self) -> bool:
        return bool(self.sequences) or bool(self._pending)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.blocks.usage, prefix_cache_queries=self.blocks.queries,
            prefix_cache_hits=self.blocks.hits, num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens, generation_tokens=self.generation_tokens,
            num_blocks=self.blocks.num_blocks, block_size=self.blocks.block_size,
            kv_bytes_per_token=self.kv_bytes_per_token,
        )

    # --- one step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        outputs += self._expire(time.monotonic())
        ahead, self._ahead = self._ahead, None
        if ahead is not None:  # the scheduler sees each sequence with its token in flight
            for seq in ahead.seqs:
                if seq.status is not Status.FINISHED:
                    seq.token_ids.append(PENDING)
        scheduled = self.scheduler.schedule()
        if ahead is not None:
            if self._follows(ahead, scheduled):
                return outputs + self._step_ahead(ahead, scheduled)
            outputs += self._settle(ahead)
            scheduled = [(seq, count) for seq, count in scheduled if seq.status is not Status.FINISHED]
        if not scheduled:
            return outputs
        # A prompt found whole in the prefix cache still computes its last token: a (short) prefill.
        prefills = [(seq, count) for seq, count in scheduled if seq.is_prefilling or seq.metrics.first_token is None]
        graphed_decode = self.runner.graphs is not None and self.runner.graphs.fits(scheduled)
        started = time.monotonic()
        finished_chunks, logits = self.runner.run(scheduled)
        for seq, count in scheduled:
            seq.num_computed += count
            self.blocks.register_full_blocks(seq)
        drawn = self._draw(finished_chunks, logits) if logits is not None else None
        now = time.monotonic()
        for seq, count in prefills:
            seq.metrics.prefill_chunks.append((started, now, count))
        if drawn is not None and self.config.run_ahead and graphed_decode and not prefills:  # first tokens: now
            self._ahead = InFlight.start(finished_chunks, *drawn, [s.params.logprobs for s in finished_chunks])
        elif drawn is not None:
            tokens, logprobs = read_tokens(*drawn, [s.params.logprobs for s in finished_chunks])
            for seq, token, logprob in zip(finished_chunks, tokens, logprobs):
                outputs.append(self._append(seq, token, logprob, now))
        return outputs

    def _draw(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return draw_tokens(logits, [s.params for s in seqs], [s.generator_on(logits.device) for s in seqs],
                           [s.params.logprobs for s in seqs])

    def _follows(self, ahead: InFlight, scheduled: list[tuple[Sequence, int]]) -> bool:
        """Whether this step can run before the tokens in flight are read: the same sequences decoding
        again, in the same order, through a graph, and none of them ended by length by its token in
        flight (an end by a stop token is seen only later: that sequence's row of this step is dropped)."""
        return (len(scheduled) == len(ahead.seqs) and self.runner.graphs is not None
                and all(s is seq and count == 1 and seq.status is Status.RUNNING
                        and len(seq.output_ids) + 1 < seq.params.max_tokens and seq.num_tokens < self.max_model_len
                        for (s, count), seq in zip(scheduled, ahead.seqs))
                and self.runner.graphs.fits(scheduled))

    def _step_ahead(self, ahead: InFlight, scheduled: list[tuple[Sequence, int]]) -> list[RequestOutput]:
        """Launch this decode step on the tokens in flight (read by its graph on the device), start its own
        tokens on their way, then read the previous step's."""
        seqs = [seq for seq, _ in scheduled]
        _, logits = self.runner.run(scheduled, ahead.tokens)
        self._ahead = InFlight.start(seqs, *self._draw(seqs, logits), [s.params.logprobs for s in seqs])
        outputs = self._settle(ahead)
        for seq in seqs:
            if seq.status is not Status.FINISHED:
                seq.num_computed += 1
                self.blocks.register_full_blocks(seq)  # after _settle: its blocks hold real tokens now
        return outputs

    def _settle(self, ahead: InFlight) -> list[RequestOutput]:
        """Read the tokens in flight and give them to their sequences (in place of PENDING), with the
        stops and outputs of any step; sequences that finished meanwhile (aborted, expired) get none."""
        tokens, logprobs = ahead.read()
        now = time.monotonic()
        outputs = []
        for seq, token, logprob in zip(ahead.seqs, tokens, logprobs):
            if seq.status is Status.FINISHED:
                continue
            assert seq.token_ids[-1] == PENDING
            seq.token_ids.pop()
            outputs.append(self._append(seq, token, logprob, now))
        return outputs

    def _append(self, seq: Sequence, token: int, logprob: float | None, now: float) -> RequestOutput:
        seq.append_token(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        m = seq.metrics
        if m.first_token is None:
            m.first_token = now
            self.prompt_tokens += len(seq.prompt_ids)
            if self.first_token_at is None:
                self.first_token_at = now
        m.token_times.append(now)
        m.generation_tokens += 1
        self.generation_tokens += 1
        params = seq.params
        stop_token = token in params.stop_token_ids or (token in self.eos_ids and not params.ignore_eos)
        tracker = self.texts.get(seq.request_id)
        hit_stop_string = False
        if tracker is not None:
            started = time.monotonic()
            hit_stop_string = tracker.add(seq.output_ids, stop_token)
            m.note_detokenize(started, time.monotonic())
        if stop_token or hit_stop_string:
            self._finish(seq, "stop")
        elif len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, "length")
        return self._output(seq, [token], [logprob] if logprob is not None else [])

    def _output(self, seq: Sequence, tokens: list[int], logprobs: list[float] | None = None) -> RequestOutput:
        tracker = self.texts.get(seq.request_id)
        finished = seq.status is Status.FINISHED
        text = tracker.take(finished) if tracker is not None else ""
        if finished:
            self.texts.pop(seq.request_id, None)
        return RequestOutput(
            seq.request_id, tokens, text, logprobs or [], finished, seq.finish_reason,
            len(seq.prompt_ids), len(seq.output_ids), seq.metrics if finished else None,
        )

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.remove(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason
        seq.metrics.finished, seq.metrics.finish_reason = time.monotonic(), reason
        self.sequences.pop(seq.request_id, None)

    def _expire(self, now: float) -> list[RequestOutput]:
        late = [s for s in self.sequences.values() if s.deadline is not None and now > s.deadline]
        for seq in late:
            self._finish(seq, "timeout")
        return [self._output(seq, []) for seq in late]


def load_engine(model: Path, device: str = "cpu", dtype: torch.dtype | None = None,
                config: EngineConfig | None = None, phase=None) -> LLMEngine:
    """Load a checkpoint (dense or compressed-tensors quantized, kept packed) and its tokenizer.
    phase(name): a context manager timing "load_weights" and "build_cache" (server/startup.py)."""
    from quantship.models.loader import Checkpoint
    from quantship.models.quantized import use_cpu_kernels
    from quantship.models.tokenizer import eos_ids, load_tokenizer

    phase = phase or (lambda name: contextlib.nullcontext())
    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    tokenizer = load_tokenizer(Path(model))
    memory.prefer_expandable_segments(torch.device(device))  # before the weights: their segments grow too
    with phase("load_weights"):
        checkpoint = Checkpoint(model)
        loaded = checkpoint.load_model(dtype, device)
        if device == "cpu":
            use_cpu_kernels(loaded)
    with phase("build_cache"):
        return LLMEngine(loaded, config, tokenizer, eos_ids(tokenizer, checkpoint.config.eos_token_id))
