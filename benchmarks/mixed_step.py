"""A step that mixes decodes with a prompt chunk: run as parts (decodes apart) against padded together.

    .venv/bin/python benchmarks/mixed_step.py run                      # bundled model, CPU
On the GPU machine (random weights of the real config, a few layers; graphs play no part: mixed
steps run eagerly):
    PYTHONPATH=src python3 benchmarks/mixed_step.py run --shape v2-lite --layers 4 --device cuda \
        --contexts 2048,8192 --decodes 255 --out $OUT

Continuous batching prefills a new prompt in chunks while the running sequences decode, in the same
step. The engine used to pad every sequence of such a step to the chunk's length, so each decode
attended with as many (masked) queries as the chunk has tokens: with 255 decodes beside a 257-token
chunk of an 8K prompt, a V2-Lite-shaped step took about 6 s on an H200 (benchmarks/capacity_check.py's
trials). models/paged.py now builds such a step as parts, each padded alone (PagedBatch.each). Measured
here, in one run: one mixed step's forward (the model's whole step: every layer, the MoE, the chunk's
logits) with D sequences decoding at context L beside a chunk of C tokens of a prompt that ends at L,
both ways on the same cache, alternating, median of ROUNDS, and the largest logit difference.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from _report import registered, run_or_render, table, update_section  # noqa: E402

ROUNDS, BLOCK = 5, 16


def _model(shape: str, layers: int | None, device: str, dtype: torch.dtype):
    from quantship.models.bundled import TINY_DIR
    from quantship.models.loader import load_model

    if shape == "bundled":
        return load_model(TINY_DIR, dtype, device=device)
    from quantize_speed import random_model

    return random_model(shape, device, dtype, layers)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(model, context: int, decodes: int, chunk: int, device: str) -> dict:
    """Seconds of one mixed step split into parts and padded together (medians), and how far apart
    their logits are."""
    from quantship.models import paged

    per_seq = -(-context // BLOCK)
    seqs = decodes + 1
    kv = [torch.zeros(seqs * per_seq * BLOCK, paged.cache_width(model.config), dtype=next(model.parameters()).dtype,
                      device=device) for _ in model.model.layers]
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(seqs)]
    starts = [context - 1] * decodes + [context - chunk]  # the cache's contents are zeros: the cost is the same
    counts = [1] * decodes + [chunk]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, min(1000, model.config.vocab_size), (1, sum(counts)), generator=g).to(device)
    ends = torch.tensor(counts).cumsum(0).to(device) - 1
    times: dict[str, list[float]] = {"parts": [], "padded": []}
    logits = {}
    with torch.inference_mode():
        for round_ in range(ROUNDS + 1):  # the first round warms up
            for way in ("parts", "padded"):
                _sync(device)
                start = time.perf_counter()
                batch, positions = paged.PagedBatch.build(kv, tables, starts, counts, BLOCK, torch.device(device),
                                                          split=way == "parts")
                hidden = model.hidden_states(ids, positions, batch)[0]
                logits[way] = model.lm_head(hidden[ends]).float()
                _sync(device)
                if round_:
                    times[way].append(time.perf_counter() - start)
    parts, padded = statistics.median(times["parts"]), statistics.median(times["padded"])
    return {"context": context, "decodes": decodes, "chunk": chunk, "parts_s": parts, "padded_s": padded,
            "speedup": padded / parts, "max_logit_diff": (logits["parts"] - logits["padded"]).abs().max().item()}


def run(args) -> None:
    torch.set_num_threads(args.threads) if args.device == "cpu" else None
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    model = _model(args.shape, args.layers, args.device, dtype)
    chunk_budget = 512  # EngineConfig's max_num_batched_tokens: the chunk is what the decodes leave of it
    rows = []
    for context in args.contexts:
        chunk = max(1, min(context, chunk_budget - args.decodes))
        rows.append(measure(model, context, args.decodes, chunk, args.device))
        print(json.dumps(rows[-1]), flush=True)
    result = {"shape": args.shape, "layers": model.config.num_hidden_layers, "device": args.device,
              "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "dtype": str(dtype).replace("torch.", ""), "threads": torch.get_num_threads(), "rounds": ROUNDS,
              "torch": torch.__version__, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"mixed_step_{args.device}.json").write_text(json.dumps(result, indent=2))


def render(paths: list[str]) -> None:
    text = ["## Mixed steps: decodes apart from the prompt chunk", "",
            "`benchmarks/mixed_step.py`: one engine step in which D sequences decode at context L while a new "
            "prompt's chunk of C tokens (what the decodes leave of the 512-token step budget) is prefilled, as "
            "continuous batching makes it. \"padded\" is the step as the engine ran it before (one batch, every "
            "decode padded to the chunk's length), \"parts\" as it runs now (decodes and the chunk padded apart); "
            "the same model, cache and tokens, alternating, median of the rounds; the whole step (every layer, "
            "the chunk's logits). The last column is the largest difference between the two ways' logits."]
    for r in registered(paths):
        where = r["device_name"] if r["device"] == "cuda" else f"CPU, {r['threads']} threads"
        text += ["", f"**{r['shape']} ({r['layers']} layers), {r['dtype']}, {where}, torch {r['torch']}**", "",
                 table(["context L", "decodes D", "chunk C", "padded ms", "parts ms", "speed-up", "max logit diff"],
                       [[x["context"], x["decodes"], x["chunk"], f"{1e3 * x['padded_s']:.1f}",
                         f"{1e3 * x['parts_s']:.1f}", f"{x['speedup']:.1f}x", f"{x['max_logit_diff']:.1e}"]
                        for x in r["rows"]])]
    update_section("mixed_step", "\n".join(text))


def _run_arguments(r) -> None:
    r.add_argument("--shape", default="bundled", help="bundled, or a shape of quantize_speed.py (random weights)")
    r.add_argument("--layers", type=int, help="decoder layers of a shape (default: all)")
    r.add_argument("--device", default="cpu")
    r.add_argument("--contexts", type=lambda t: [int(x) for x in t.split(",")], default=[512, 1024, 2048])
    r.add_argument("--decodes", type=int, default=32)
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--out", default="benchmarks/results")


if __name__ == "__main__":
    run_or_render(__doc__, _run_arguments, run, render)
