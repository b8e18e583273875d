"""GPU: a decode step's embedding gather three ways, inside a CUDA graph (models.layers.embed's choice).

nn.Embedding (F.embedding) runs index_select, whose CUDA kernel for 16 ids or fewer walks the ids one after
another in each thread; indexing (weight[ids]) gathers over all the rows' elements at once. Each way is
captured 20 times in one graph, replayed 10 times after a 256 MB buffer is zeroed (so the table's rows come
from memory, not L2), and the median per call is printed, for 1, 16 and 64 ids of a 6.7B model's table.

    python benchmarks/embedding_gather.py > benchmarks/results/embedding_gather_<gpu>.txt
"""

import torch
import torch.nn.functional as F


def per_call_us(fn, flush: torch.Tensor, calls: int = 20, replays: int = 10) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the graph, as capture asks
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays):
        flush.zero_()
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls * 1000)
    return sorted(times)[len(times) // 2]


def main() -> None:
    table = torch.randn(32256, 4096, dtype=torch.bfloat16, device="cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for rows in (1, 16, 64):
        ids = torch.randint(0, table.shape[0], (rows,), device="cuda")
        ways = {"F.embedding": lambda: F.embedding(ids, table), "weight[ids]": lambda: table[ids],
                "index_select": lambda: table.index_select(0, ids)}
        expected = F.embedding(ids, table)
        for name, fn in ways.items():
            assert torch.equal(fn(), expected), name
            print(f"rows {rows:3d} {name:13s} {per_call_us(fn, flush):.2f} us/call (graph, 20 calls)")


if __name__ == "__main__":
    main()
