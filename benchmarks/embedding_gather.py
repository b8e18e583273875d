"""GPU: a decode step's embedding gather three ways, inside a CUDA graph (models.layers.Embedding's choice).

nn.Embedding (F.embedding) runs index_select, whose CUDA kernel for 16 ids or fewer walks the ids one after
another in each thread; indexing (weight[ids]) gathers over all the rows' elements at once. Each way is
captured 20 times in one graph, replayed 10 times after a 256 MB buffer is zeroed (so the table's rows come
from memory, not L2), and the median per call is kept, for 1, 16 and 64 ids of a 6.7B model's table.

    python benchmarks/embedding_gather.py run --out DIR      # on the GPU machine
    python benchmarks/embedding_gather.py render DIR/embedding_gather_*.json
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))

from _report import registered, run_or_render, table, update_section, write_run  # noqa: E402

CALLS, REPLAYS, ROWS = 20, 10, (1, 16, 64)


def per_call_us(fn, flush: torch.Tensor) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the graph, as capture asks
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    times = []
    for _ in range(REPLAYS):
        flush.zero_()
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / CALLS * 1000)
    return sorted(times)[len(times) // 2]


def run(args) -> None:
    weights = torch.randn(32256, 4096, dtype=torch.bfloat16, device="cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    for count in ROWS:
        ids = torch.randint(0, weights.shape[0], (count,), device="cuda")
        ways = {"F.embedding": lambda: F.embedding(ids, weights), "weight[ids]": lambda: weights[ids],
                "index_select": lambda: weights.index_select(0, ids)}
        expected = F.embedding(ids, weights)
        for name, fn in ways.items():
            assert torch.equal(fn(), expected), name
            rows.append({"rows": count, "way": name, "us_per_call": per_call_us(fn, flush)})
            print(rows[-1], flush=True)
    device = torch.cuda.get_device_name()
    result = {"device_name": device, "torch": torch.__version__, "calls_per_graph": CALLS, "replays": REPLAYS,
              "rows": rows}
    write_run(args.out, "embedding_gather_" + re.sub(r"\W+", "_", device.lower()).strip("_"), result)


def render(paths: list[str]) -> None:
    text = ["## Embedding gather: nn.Embedding against indexing", "",
            "`benchmarks/embedding_gather.py`: one decode step's token rows gathered from a 6.7B model's table "
            f"(32,256 x 4,096, bf16), {CALLS} calls captured in a CUDA graph, the median of {REPLAYS} replays, "
            "each after a 256 MB buffer is zeroed so the rows come from memory. `models.layers.Embedding` "
            "indexes for 2-16 ids, where index_select's small-index kernel walks the ids one after another."]
    for r in registered(paths):
        ways = list(dict.fromkeys(row["way"] for row in r["rows"]))
        by = {(row["rows"], row["way"]): row["us_per_call"] for row in r["rows"]}
        counts = sorted({row["rows"] for row in r["rows"]})
        text += ["", f"**{r['device_name']}, torch {r['torch']}** (µs a call)", "",
                 table(["ids"] + ways + ["F.embedding / weight[ids]"],
                       [[n] + [f"{by[n, w]:.2f}" for w in ways] + [f"{by[n, 'F.embedding'] / by[n, 'weight[ids]']:.2f}x"]
                        for n in counts])]
    update_section("embedding_gather", "\n".join(text))


def _run_arguments(p) -> None:
    p.add_argument("--out", default=".", help="folder for the JSON (on the GPU machine: $OUT)")


if __name__ == "__main__":
    run_or_render(__doc__, _run_arguments, run, render)
