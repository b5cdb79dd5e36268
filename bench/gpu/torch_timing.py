"""Timing shared by the PyTorch-based GPU benchmarks (bench/gpu/*_bench.py): CUDA-graph replays after an L2
flush, and the same-run device copy ceiling."""
import numpy as np
import torch

DEV = "cuda"
_FLUSH = None


def timed(fn, reps, graph=True):
    """Median ms of `reps` runs of `fn`, each after a 256 MiB write that evicts the L2 (untimed). With `graph`
    the launches are captured into a CUDA graph first (warmed up on a side stream), so the time is the GPU's,
    not Python's; without, eager launches are timed (the copy, library baselines that refuse capture)."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device=DEV)
    run = fn
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    times = []
    for _ in range(reps):
        _FLUSH.fill_(0x5A)
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        z.record()
        z.synchronize()
        times.append(a.elapsed_time(z))
    return float(np.median(times))


def copy_gbps():
    """Device-to-device copy of 1 GiB, eager: (read + written bytes) / time, GB/s."""
    n = 1 << 30
    a, b = torch.ones(n, dtype=torch.uint8, device=DEV), torch.empty(n, dtype=torch.uint8, device=DEV)
    t = timed(lambda: b.copy_(a), 10, graph=False)
    del a, b
    return 2 * n / t / 1e6
