"""The serving engine against the plain one-request loop: same greedy tokens under batching,
chunked prefill, prefix caching and preemption; scheduling rules; sampling; cache size."""

import pytest
import torch

from quantship.engine.config import EngineConfig
from quantship.engine.engine import LLMEngine, QueueFull
from quantship.engine.sampling_params import SamplingParams
from quantship.models.bundled import TINY_DIR
from quantship.models.loader import load_model
from quantship.models.paged import cache_width, full_kv_width
from quantship.models.reference_loop import generate_tokens
from quantship.models.tokenizer import load_tokenizer
from quantship.quant.pipeline import QuantizeOptions, quantize

# float64 on both sides: batching changes summation order, and greedy choices on random
# models have near-ties that float32 noise could flip; in float64 only a real bug can.
DTYPE = torch.float64


def staggered_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    shared = ids(21)
    # Two share a 5-block prefix, one is longer than a step's token budget (chunked prefill).
    return [shared + ids(3), ids(7), shared + ids(6), ids(61), ids(2), shared[:9]]


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, every: int = 2,
        params: dict | None = None) -> dict[str, list[int]]:
    """Requests arrive one every `every` steps while earlier ones are mid-flight."""
    outputs = {str(i): [] for i in range(len(prompts))}
    queue, step = list(enumerate(prompts)), 0
    while queue or engine.has_unfinished():
        if queue and step % every == 0:
            i, prompt = queue.pop(0)
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                              **(params or {})))
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
        step += 1
        assert step < 5000, "engine made no progress"
    return outputs


def assert_matches_reference(model, engine, prompts, max_tokens=12):
    got = run(engine, prompts, max_tokens)
    for i, prompt in enumerate(prompts):
        assert got[str(i)] == list(generate_tokens(model, prompt, max_tokens)), f"request {i}"
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
    return stats


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2_group", "deepseek_v2_greedy", "llama"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_matches_plain_loop(reference_dirs, name, prefix_caching):
    model = load_model(reference_dirs[name][0], DTYPE)
    config = EngineConfig(block_size=4, max_num_batched_tokens=16, enable_prefix_caching=prefix_caching)
    stats = assert_matches_reference(model, LLMEngine(model, config), staggered_prompts(model.config.vocab_size))
    assert (stats.prefix_cache_hits > 0) == prefix_caching


@pytest.mark.parametrize("name", ["deepseek_v3", "llama"])
def test_greedy_matches_after_preemption(reference_dirs, name):
    model = load_model(reference_dirs[name][0], DTYPE)
    config = EngineConfig(block_size=4, max_num_batched_tokens=16, num_blocks=24)
    stats = assert_matches_reference(model, LLMEngine(model, config), staggered_prompts(model.config.vocab_size), 16)
    assert stats.num_preemptions > 0


@pytest.fixture(scope="module")
def w4a16_dirs(tmp_path_factory, llama_dir):
    """The bundled DeepSeek-V3 and a DeepSeek-Coder-shaped Llama, quantized by our own pipeline."""
    root = tmp_path_factory.mktemp("w4a16")
    out = {}
    for name, source in (("tiny", "tiny"), ("llama", llama_dir)):
        out[name] = root / name
        quantize(source, out[name], QuantizeOptions(scheme="W4A16", group_size=64, samples=4, seq_len=64))
    return out


@pytest.mark.parametrize("name", ["tiny", "llama"])
def test_greedy_matches_on_quantized_checkpoints(w4a16_dirs, name):
    model = load_model(w4a16_dirs[name], DTYPE)
    assert any(type(m).__name__ == "PackedLinear" for m in model.modules())  # kept packed, not dequantized
    config = EngineConfig(block_size=8, max_num_batched_tokens=24, num_blocks=12)
    stats = assert_matches_reference(model, LLMEngine(model, config), staggered_prompts(1000, seed=1), 10)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


@pytest.mark.parametrize("scheme", ["W4A16", "W8A16"])
def test_serving_on_the_cpu_runs_packed_layers_through_the_kernels(w4a16_dirs, tmp_path, scheme):
    """load_engine (what `serve` uses) sends every packed Linear through PyTorch's CPU kernels (int4, int8
    per channel), and the engine still gives the plain loop's greedy tokens on the same model (the bundled
    trained model, natural prompts: float32 with bf16 activations, where random weights would have
    near-ties)."""
    from quantship.engine.engine import load_engine
    from quantship.models.quantized import PackedLinear

    source = w4a16_dirs["tiny"]
    if scheme == "W8A16":
        source = tmp_path / "w8a16"
        quantize("tiny", source, QuantizeOptions(scheme="W8A16", method="rtn"))
    engine = load_engine(source, config=EngineConfig(max_model_len=256, max_num_seqs=4))
    model, tokenizer = engine.model, engine.tokenizer
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert packed and all(m.cpu_kernel and m.decode_weights() is not None for m in packed)
    prompts = [tokenizer(text)["input_ids"] for text in ("def fibonacci(n):", "The capital of", "import numpy as")]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=16, ignore_eos=True))
    got = {rid: [t for out in outs for t in out.new_token_ids] for rid, outs in drain(engine).items()}
    for i, prompt in enumerate(prompts):
        assert got[str(i)] == list(generate_tokens(model, prompt, 16)), f"prompt {i}"
    # The exact path (dequantize + F.linear, what the verifier measures) on the same weights is close.
    exact = load_model(source, torch.float32)
    ids = torch.tensor([sum(prompts, [])])
    with torch.no_grad():
        a, b = model(ids)[0], exact(ids)[0]
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9
    assert (a - b).norm() / b.norm() < 0.05


@pytest.fixture(scope="module")
def tiny():
    return load_model(TINY_DIR, torch.float32), load_tokenizer(TINY_DIR)


def drain(engine: LLMEngine) -> dict[str, list]:
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def test_higher_priority_is_admitted_first_and_preempted_last(tiny):
    model, _ = tiny
    engine = LLMEngine(model, EngineConfig(block_size=4, max_num_seqs=2, num_blocks=10))
    order = []
    for rid, priority in (("low-a", 0), ("low-b", 0), ("high", 5)):
        engine.add_request(rid, list(range(10, 18)), SamplingParams(max_tokens=20, ignore_eos=True), priority)
    steps_with_token: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished():
        for out in engine.step():
            steps_with_token.setdefault(out.request_id, []).append(step)
            if out.finished:
                order.append(out.request_id)
        step += 1
    assert order[0] == "high"
    assert engine.stats().num_preemptions > 0
    high = steps_with_token["high"]
    assert high == list(range(high[0], high[0] + 20))  # never preempted: a token every step


def test_bounded_queue_deadline_and_abort_free_everything(tiny):
    model, _ = tiny
    engine = LLMEngine(model, EngineConfig(max_waiting=2, block_size=4))
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    engine.add_request("a", [5] * 9, params)
    engine.add_request("b", [6] * 9, params, deadline=0.0)  # already late
    with pytest.raises(QueueFull):
        engine.add_request("c", [7] * 9, params)
    outs = {o.request_id: o for o in engine.step()}
    assert outs["b"].finished and outs["b"].finish_reason == "timeout"
    assert engine.stats().kv_cache_usage > 0
    engine.abort("a")
    (out,) = engine.step()
    assert out.finish_reason == "abort" and engine.stats().kv_cache_usage == 0 and not engine.has_unfinished()
    with pytest.raises(ValueError, match="context"):
        engine.add_request("d", [1] * engine.max_model_len, params)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("e", [1], SamplingParams(max_tokens=0))


def test_sampling_seed_top_k_and_logprobs(tiny):
    model, _ = tiny
    prompt = [100, 200, 300, 400]

    def tokens(**params):
        engine = LLMEngine(model, EngineConfig())
        engine.add_request("r", prompt, SamplingParams(max_tokens=16, ignore_eos=True, **params))
        outs = drain(engine)["r"]
        return [t for o in outs for t in o.new_token_ids], [lp for o in outs for lp in o.logprobs]

    greedy, logprobs = tokens(logprobs=True)
    assert tokens(temperature=1.0, top_k=1)[0] == greedy
    assert tokens(temperature=1.0, seed=7)[0] == tokens(temperature=1.0, seed=7)[0]
    assert tokens(temperature=1.0, seed=7)[0] != tokens(temperature=1.0, seed=8)[0]
    with torch.no_grad():
        full = model(torch.tensor([prompt + greedy]))[0, len(prompt) - 1:-1].log_softmax(-1)
    expected = full.gather(1, torch.tensor(greedy)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-4)


def test_stop_strings_and_stop_tokens(tiny):
    model, tokenizer = tiny
    prompt = tokenizer.encode("def fibonacci(n):")

    def generate(**params):
        engine = LLMEngine(model, EngineConfig(), tokenizer)
        engine.add_request("r", prompt, SamplingParams(max_tokens=40, ignore_eos=True, **params))
        outs = drain(engine)["r"]
        return "".join(o.text for o in outs), [t for o in outs for t in o.new_token_ids], outs[-1].finish_reason

    text, ids, reason = generate()
    assert reason == "length" and text == tokenizer.decode(ids, skip_special_tokens=True)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut, _, reason = generate(stop=[stop])
    assert reason == "stop" and cut == text[:text.index(stop)]
    _, stopped_ids, reason = generate(stop_token_ids=[ids[5]])
    assert reason == "stop" and stopped_ids == ids[:ids.index(ids[5]) + 1]


def test_mla_cache_holds_the_latent_not_full_kv(tiny, reference_dirs):
    model, _ = tiny
    c = model.config
    assert cache_width(c) == c.kv_lora_rank + c.qk_rope_head_dim
    assert full_kv_width(c) / cache_width(c) > 4
    engine = LLMEngine(model, EngineConfig(num_blocks=3, block_size=16))
    assert engine.stats().kv_bytes_per_token == cache_width(c) * c.num_hidden_layers * 4
    assert engine.runner.kv[0].shape == (64, cache_width(c))  # 3 blocks and the scratch block
    llama = load_model(reference_dirs["llama"][0]).config
    assert cache_width(llama) == full_kv_width(llama) == 2 * llama.num_key_value_heads * llama.llama_head_dim


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
@pytest.mark.parametrize("pdl", ["0", "1"])
def test_cuda_graph_decode_matches_plain_loop(reference_dirs, name, pdl, monkeypatch):
    """On a GPU, decode steps and steps of prompt chunks replay CUDA graphs (MoE layers through the fused
    experts), decode steps run one ahead of their tokens' reading; the tokens must not change. Also with
    programmatic dependent launch (on Hopper: kernels overlapping the one before, a race if one read or
    wrote before its wait)."""
    monkeypatch.setenv("QUANTSHIP_PDL", pdl)
    # float32, not the float64 of the CPU tests: the Triton kernels (fused experts, paged decode attention)
    # compile for 16- and 32-bit floats and float64 stays on the plain-torch path.
    model = load_model(reference_dirs[name][0], torch.float32, device="cuda")
    engine = LLMEngine(model, EngineConfig(block_size=4, max_num_batched_tokens=16))
    assert_matches_reference(model, engine, staggered_prompts(model.config.vocab_size), 16)
    moe = [m for m in model.modules() if hasattr(m, "enable_fused_kernels")]
    assert (name == "deepseek_v3") == bool(moe) and all(m.fused is not None for m in moe)
    assert engine.runner.graphs is not None
    assert len(engine.runner.graphs.graphs) >= 2  # several batch sizes were replayed
    assert engine.runner.prefill_graphs.graphs  # and steps of prompt chunks, decodes run ahead among them


def test_incremental_detokenization_equals_a_full_decode(tiny):
    from quantship.engine.text import TextTracker

    _, tokenizer = tiny
    g = torch.Generator().manual_seed(0)
    samples = [tokenizer.encode("naïve café — “quotes” 東京 🙂 done\n    return x", add_special_tokens=False),
               torch.randint(0, tokenizer.vocab_size, (300,), generator=g).tolist()]
    for ids in samples:
        tracker, streamed = TextTracker(tokenizer, []), ""
        for i in range(1, len(ids) + 1):
            tracker.add(ids[:i], False)
            streamed += tracker.take(False)
        streamed += tracker.take(True)
        assert streamed == tracker.text == tokenizer.decode(ids, skip_special_tokens=True)


def test_decode_batch_built_on_the_device_equals_the_host_build():
    """PagedBatch.for_decode (what a CUDA graph replays) gives every field `build` gives for a decode step."""
    from quantship.models.paged import PagedBatch

    kv = [torch.zeros(40 * 4, 8)]
    tables = [[3, 7, 1], [5], [2, 9, 4, 8, 6], [0]]
    starts = [9, 2, 17, 0]  # the token each sequence computes now; its context is start + 1 keys
    for key_len in (None, 32):
        built, positions = PagedBatch.build(kv, tables, starts, [1] * 4, 4, torch.device("cpu"), key_len)
        width = max(map(len, tables))
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
        k = built.key_slots.shape[1]
        made, made_positions = PagedBatch.for_decode(kv, padded, torch.tensor(starts) + 1, 4, k)
        assert torch.equal(made_positions, positions)
        for name in ("slots", "query_index", "query_valid", "unpad_index", "mask", "key_lengths"):
            assert torch.equal(getattr(made, name), getattr(built, name)), name
        for s, start in enumerate(starts):  # key slots agree where a sequence has keys; the rest is masked
            assert torch.equal(made.key_slots[s, :start + 1], built.key_slots[s, :start + 1])


@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_the_graph_inputs_give_the_eager_step_logits(reference_dirs, name):
    """What a CUDA graph replays, run eagerly on CPU: the staged rows (token, context length, block
    table; padded to the bucket) through PagedBatch.for_decode give the eager decode step's logits."""
    from quantship.engine.cuda_graphs import stage_rows
    from quantship.models.paged import PagedBatch

    model = load_model(reference_dirs[name][0], DTYPE)
    engine = LLMEngine(model, EngineConfig(block_size=4, num_blocks=32))
    for i, prompt in enumerate(([5, 6, 7], [8] * 9, [9, 10] * 5)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=4, temperature=0))
    engine.step()  # the prefill: each sequence now has one new token to decode
    scheduled = [(seq, 1) for seq in engine.sequences.values()]
    assert all(seq.num_tokens == seq.num_computed + 1 for seq, _ in scheduled)
    runner = engine.runner
    eager = runner.run(scheduled)[1]
    size, width, scratch = 4, 8, 32  # one padding row; the scratch block is the runner's spare block
    staged = stage_rows(scheduled, size, width, scratch)
    assert staged[3].tolist() == [0, 1] + [scratch] * width
    with torch.inference_mode():
        batch, positions = PagedBatch.for_decode(runner.kv, staged[:, 2:], staged[:, 1], 4, width * 4)
        graphed = model.lm_head(model.hidden_states(staged[:, 0][None], positions, batch)[0])
    torch.testing.assert_close(graphed[:3], eager, rtol=1e-9, atol=1e-9)


def test_chunk_batch_built_on_the_device_equals_the_host_build():
    """PagedBatch.for_prefill (what a graph of chunks replays) gives, at each sequence's real tokens, the
    slots, positions, masks and key slots `build` gives; its padding writes into the scratch block alone
    and sees key 0 only."""
    from quantship.models.paged import PagedBatch

    kv, block, scratch = [torch.zeros(40 * 4, 8)], 4, 39
    tables = [[3, 7, 1, 2], [5, 6], [2, 9, 4, 8, 6], [0]]
    starts, counts = [9, 0, 12, 2], [5, 7, 1, 1]
    built, positions = PagedBatch.build(kv, tables, starts, counts, block, torch.device("cpu"), split=False)
    queries, key_len, width = 8, 32, 8
    padded = torch.tensor([t + [scratch] * (width - len(t)) for t in tables] + [[scratch] * width])
    made, made_positions = PagedBatch.for_prefill(kv, padded, torch.tensor(starts + [0]), torch.tensor(counts + [0]),
                                                  block, queries, key_len, scratch)
    real = made.query_valid.flatten()
    assert made.query_valid[:4].sum(1).tolist() == counts and not made.query_valid[4].any()
    assert torch.equal(made_positions[real], positions) and torch.equal(made.slots[real], built.slots)
    assert torch.all(made.slots[~real] // block == scratch)  # padding writes no sequence's block
    assert torch.equal(made.key_lengths[:4], built.key_lengths)
    longest = built.mask.shape[-1]
    assert torch.equal(made.mask[:4, 0, :, :longest][made.query_valid[:4]], built.mask[:, 0][built.query_valid])
    assert not made.mask[:4, :, :, longest:].any()
    padding = made.mask[:, 0][~made.query_valid]
    assert padding[:, 0].all() and not padding[:, 1:].any()
    for s, (start, count) in enumerate(zip(starts, counts)):
        assert torch.equal(made.key_slots[s, :start + count], built.key_slots[s, :start + count])


def test_whole_prompts_attend_causally_without_the_mask():
    """Where every sequence of a step computes its positions 0 .. Q-1 with no padded keys (one prompt prefilled
    whole, or equal prompts), the batch marks itself causal, and attention through that path (SDPA's flash
    kernel on the GPU) equals attention under the batch's mask; a later chunk, unequal counts or padded keys
    keep the mask."""
    from dataclasses import replace

    from quantship.models.paged import PagedBatch

    kv, block, cpu = [torch.zeros(40 * 4, 8)], 4, torch.device("cpu")
    torch.manual_seed(0)
    for starts, counts in (([0], [9]), ([0, 0, 0], [6, 6, 6])):
        batch, _ = PagedBatch.build(kv, [[1, 2, 3, 4, 5]] * len(starts), starts, counts, block, cpu)
        assert batch.causal
        # as many keys as queries: each sequence's positions 0 .. Q-1
        q, k, v = (torch.randn(len(starts), 4, counts[0], 16, dtype=DTYPE) for _ in range(3))
        fast = batch.attention(q, k, v, 0.25)
        torch.testing.assert_close(fast, replace(batch, causal=False).attention(q, k, v, 0.25), rtol=1e-9, atol=1e-9)
        future = k.clone()
        future[:, :, -1] += 1  # the last key: only the last query may see it
        moved = batch.attention(q, future, v, 0.25)
        assert torch.equal(moved[:, :, :-1], fast[:, :, :-1]) and not torch.equal(moved[:, :, -1], fast[:, :, -1])
    tables = [[1, 2, 3, 4, 5]] * 2
    for starts, counts, key_len in (([5], [7], None), ([0, 2], [6, 6], None), ([0, 0], [6, 5], None),
                                    ([0], [9], 16)):
        batch, _ = PagedBatch.build(kv, tables[:len(starts)], starts, counts, block, cpu, key_len, split=False)
        assert not batch.causal, (starts, counts, key_len)


class _EagerGraph:
    """A CUDA graph's stand-in on CPU: capture runs forward once, replay runs it again into the output."""

    def __init__(self, forward):
        self.forward, self.out = forward, forward()

    def replay(self):
        self.out.copy_(self.forward())


def _eager_record(forward, device, pool):
    graph = _EagerGraph(forward)
    return graph, graph.out, pool


@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
@pytest.mark.parametrize("budget", [16, 256])
def test_engine_with_graphs_of_every_step_matches_plain_loop(reference_dirs, monkeypatch, name, budget):
    """The graphed steps (decode, and chunks padded to their buckets, several sequences at once, after
    prefix-cache hits) replayed eagerly on CPU: greedy tokens identical to the plain loop; a step too
    large for a graph of chunks runs eagerly."""
    from quantship.engine import cuda_graphs

    model = load_model(reference_dirs[name][0], DTYPE)
    engine = graphed_engine(monkeypatch, model, EngineConfig(block_size=4, max_num_batched_tokens=budget, max_num_seqs=8))
    runner = engine.runner
    ahead = []
    real_step_ahead = LLMEngine._step_ahead
    monkeypatch.setattr(LLMEngine, "_step_ahead", lambda *a: ahead.append(1) or real_step_ahead(*a))
    # graphs of chunks up to 128 padded tokens here: with a budget of 16 every step is graphed
    runner.prefill_graphs.shapes = {shape for shape in runner.prefill_graphs.shapes if shape[0] * shape[1] <= 128}
    eager = []
    real_build = cuda_graphs.PagedBatch.build
    monkeypatch.setattr(cuda_graphs.PagedBatch, "build", lambda *a, **k: eager.append(1) or real_build(*a, **k))
    assert_matches_reference(model, engine, staggered_prompts(model.config.vocab_size))
    graphed = runner.prefill_graphs.graphs
    assert any(size > 1 for size, _, _ in graphed) and len(graphed) >= 2
    assert bool(eager) == (budget == 256)  # the 61-token prompt's chunk beside 3 running sequences: 4 x 64
    assert runner.graphs.graphs and len(ahead) >= 5  # decode steps ran ahead of their tokens' reading


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host synchronisation exists only with a device")
def test_a_decode_step_run_ahead_never_waits_for_the_gpu(reference_dirs, monkeypatch):
    """From the step's start to reading the previous step's tokens (the one wait it has): staging the
    graph's input, taking the tokens in flight, replaying, sampling (greedy, drawn, log-probs) and starting
    the copies home never synchronise with the GPU."""
    model = load_model(reference_dirs["llama"][0], torch.float32, device="cuda")
    engine = LLMEngine(model, EngineConfig(block_size=4, max_num_batched_tokens=32))
    kinds = [{}, dict(temperature=0.7, seed=1, logprobs=True), dict(temperature=1.0, top_k=5, top_p=0.9)]
    for i, kind in enumerate(kinds):
        engine.add_request(str(i), [5 + i] * 6, SamplingParams(max_tokens=20, ignore_eos=True, **kind))
    for _ in range(4):  # the prefill, then decode steps until one is in flight
        engine.step()
    assert engine._ahead is not None
    settle = engine._settle
    monkeypatch.setattr(engine, "_settle", lambda ahead: torch.cuda.set_sync_debug_mode("default") or settle(ahead))
    torch.cuda.set_sync_debug_mode("error")
    try:
        outputs = engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(outputs) == 3 and engine._ahead is not None


def graphed_engine(monkeypatch, model, config: EngineConfig) -> LLMEngine:
    """An engine on CPU with decode graphs and graphs of chunks, each replayed eagerly (_EagerGraph)."""
    from quantship.engine import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "record", _eager_record)
    engine = LLMEngine(model, config)
    runner = engine.runner
    runner.graphs = cuda_graphs.DecodeGraphs(model, runner.kv, config.block_size,
                                             runner.kv[0].shape[0] // config.block_size - 1, config.max_num_seqs,
                                             engine.max_model_len)
    runner.prefill_graphs = cuda_graphs.PrefillGraphs(runner.graphs, engine.max_model_len)
    return engine


def test_steps_run_ahead_give_what_steps_read_at_once_give(reference_dirs, monkeypatch):
    """Decode steps launched before the previous tokens are read: stop tokens (the row computed past the
    stop is dropped), seeded sampling, log-probabilities, max_tokens and an abort while a step is in flight
    give exactly what an engine reading every step's tokens at once gives, and free every block."""
    model = load_model(reference_dirs["deepseek_v3"][0], DTYPE)
    prompts = staggered_prompts(model.config.vocab_size, seed=3)
    greedy = {str(i): list(generate_tokens(model, p, 12)) for i, p in enumerate(prompts)}
    kinds = [dict(stop_token_ids=[greedy["0"][4]]), dict(temperature=0.8, seed=5, logprobs=True),
             dict(temperature=1.0, top_k=20, top_p=0.9, seed=1), dict(logprobs=True), dict(max_tokens=3), {}]

    def serve(run_ahead: bool) -> tuple[dict, LLMEngine]:
        config = EngineConfig(block_size=4, max_num_batched_tokens=32, max_num_seqs=8, run_ahead=run_ahead)
        engine = graphed_engine(monkeypatch, model, config)
        got, step = {}, 0
        for i, (prompt, kind) in enumerate(zip(prompts, kinds)):
            engine.add_request(str(i), prompt, SamplingParams(**{"max_tokens": 12, **kind}))
        while engine.has_unfinished():
            for out in engine.step():
                entry = got.setdefault(out.request_id, {"ids": [], "logprobs": [], "reason": None})
                entry["ids"] += out.new_token_ids
                entry["logprobs"] += out.logprobs
                entry["reason"] = out.finish_reason
            step += 1
            if step == 8:
                assert engine._ahead is not None or not run_ahead  # a step is in flight as the client leaves
                engine.abort("5")
        return got, engine

    ahead, engine = serve(True)
    at_once, _ = serve(False)
    aborted, aborted_at_once = ahead.pop("5"), at_once.pop("5")
    assert ahead == at_once
    # the token in flight when the client left is never delivered: the aborted stream may be one short
    assert aborted_at_once["ids"][:len(aborted["ids"])] == aborted["ids"] and len(aborted["ids"]) >= 2
    assert aborted["reason"] == "abort"
    assert ahead["0"]["ids"] == greedy["0"][:5] and ahead["0"]["reason"] == "stop"
    assert len(ahead["4"]["ids"]) == 3 and len(ahead["1"]["logprobs"]) == 12
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0


CUBLAS_OOM = "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"


def test_out_of_memory_is_recognised_whichever_library_raises_it():
    from quantship.engine.memory import out_of_memory

    assert out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB"))
    assert out_of_memory(RuntimeError(CUBLAS_OOM))
    assert not out_of_memory(RuntimeError("operation not permitted when stream is capturing"))
    assert not out_of_memory(ValueError("ALLOC_FAILED"))


class _FailingCapture:
    def __init__(self, message: str):
        self.message = message

    def capture(self, *limits):
        raise RuntimeError(self.message)


class _Captures:
    def capture(self, *limits):
        return 3


def test_graph_capture_out_of_memory_is_raised_other_failures_serve_eagerly(tiny):
    """cuBLAS running out of memory while graphs are captured is an out-of-memory (a server that went on
    eagerly would fail at its first busy step); a step that cannot be captured serves without graphs."""
    engine = LLMEngine(tiny[0], EngineConfig(num_blocks=64, max_num_seqs=4))
    engine.runner.graphs = _FailingCapture(CUBLAS_OOM)
    with pytest.raises(torch.OutOfMemoryError, match="CUBLAS_STATUS_ALLOC_FAILED"):
        engine.runner.capture_graphs(4)
    engine.runner.graphs = _FailingCapture("operation not permitted when stream is capturing")
    assert engine.runner.capture_graphs(4) == 0 and engine.runner.graphs is None
    assert run(engine, [[5, 6, 7]], 3) == {"0": list(generate_tokens(tiny[0], [5, 6, 7], 3))}  # it serves, eagerly


def test_chunk_graphs_that_cannot_be_captured_leave_the_decode_graphs(tiny):
    """Graphs of prompt chunks failing to capture: those steps run eagerly, decode graphs stay; out of
    memory is raised, as for decode graphs."""
    engine = LLMEngine(tiny[0], EngineConfig(num_blocks=64, max_num_seqs=4))
    runner = engine.runner
    runner.graphs, runner.prefill_graphs = _Captures(), _FailingCapture(CUBLAS_OOM)
    with pytest.raises(torch.OutOfMemoryError, match="CUBLAS_STATUS_ALLOC_FAILED"):
        runner.capture_graphs(4)
    runner.prefill_graphs = _FailingCapture("operation not permitted when stream is capturing")
    assert runner.capture_graphs(4) == 3 and runner.prefill_graphs is None and runner.graphs is not None
    runner.graphs, runner.prefill_graphs = _FailingCapture("operation not permitted"), _Captures()
    assert runner.capture_graphs(4) == 0 and runner.graphs is None is runner.prefill_graphs  # they share a pool


def test_serve_that_runs_out_of_memory_at_start_up_says_what_to_lower(monkeypatch, capsys):
    from quantship.cli import main
    from quantship.engine.model_runner import ModelRunner

    def out_of_memory(self, max_seqs=None, max_key_len=None):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.94 GiB.\nmore")

    monkeypatch.setattr(ModelRunner, "capture_graphs", out_of_memory)
    from test_server import free_port

    assert main(["serve", "tiny", "--device", "cpu", "--port", str(free_port())]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: out of memory (CUDA out of memory. Tried to allocate 3.94 GiB.)" in err
    assert "--kv-cache-fraction" in err and "--max-num-seqs" in err
