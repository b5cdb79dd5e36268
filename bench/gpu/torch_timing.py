"""Timing shared by the PyTorch-based GPU benchmarks (bench/gpu/*_bench.py): CUDA-graph replays after an L2
flush, and the same-run device copy ceiling.

The flush reads 256 MiB (the L2 left full of clean lines that are not the kernel's), as a kernel in a model
step finds it after the kernels before it read their weights. TANDEM_FLUSH=write flushes by writing 256 MiB
instead (the method before 2026-11-27): that leaves the whole L2 dirty, and a kernel reading less than a few
hundred MB then pays up to 50 MB of write-backs (H100) inside its own time - measured, small-M FP8 GEMMs
and cuBLASLt alike lose 10-25% of their apparent bandwidth to it."""
import os

import numpy as np
import torch

DEV = "cuda"
_FLUSH = None
WRITE_FLUSH = os.environ.get("TANDEM_FLUSH") == "write"


def timed(fn, reps, graph=True):
    """Median ms of `reps` runs of `fn`, each after a 256 MiB read (or write) that evicts the L2 (untimed). With `graph`
    the launches are captured into a CUDA graph first (warmed up on a side stream), so the time is the GPU's,
    not Python's; without, eager launches are timed (the copy, library baselines that refuse capture)."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.full((256 << 20,), 0x5A, dtype=torch.uint8, device=DEV)
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
        if WRITE_FLUSH:
            _FLUSH.fill_(0x5A)
        else:
            torch.amax(_FLUSH)
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
