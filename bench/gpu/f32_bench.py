"""Benchmark of the f32 linears (engine/kernels/model.cu): the tiled kernel (`tandem_gemm_f32_tiled`, rows sharing
weight reads) next to the row kernel it replaces for one matrix (`tandem_gemm_f32`, the same bits) on
DeepSeek-V3.2's f32 products: the MoE router gate (256 x 7168) and the indexer's weights_proj (64 x 7168), and
the same-run copy bandwidth.

  python3 bench/gpu/f32_bench.py [--json FILE]

F32_DEFINES (e.g. "-DF32T_COLS=4 -DF32T_ROWS=16") times a variant of the tiled kernel. Each timing is a CUDA-graph
replay after an L2 flush, median of the runs. The script checks that both kernels give the same bits first.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bf16_bench import run  # noqa: E402
from cuda_driver import DEV, I, L, P, build, launcher, report  # noqa: E402
from torch_timing import copy_gbps, timed  # noqa: E402

DEFINES = os.environ.get("F32_DEFINES", "").split()
_D = dict(d[2:].split("=") for d in DEFINES if d.startswith("-D") and "=" in d)
COLS, ROWS, WARPS = int(_D.get("F32T_COLS", 4)), int(_D.get("F32T_ROWS", 8)), 8


# Both kernels are timed adding their K chunks in sequence (`part` null); the backend runs these narrow
# products split across CTAs with tandem_gemm_f32_combine (the same bits; engine::cuda::weights tests them),
# which engine-bench's decode steps measure.
def chunk(k):
    # engine::cuda::weights::f32_chunk: at most 8 chunks of a multiple of 512 channels (both kernels add the
    # chunks' sums in sequence here; the backend splits the narrow ones across CTAs, the same sums).
    return 512 * max(1, -(-(-(-k // 512)) // 8))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    fns = build("model.cu", ["tandem_gemm_f32", "tandem_gemm_f32_tiled"], DEFINES)
    copy = copy_gbps()
    print(f"same-run copy: {copy:.0f} GB/s; {torch.cuda.get_device_name(0)}; tile {COLS} columns x {ROWS} rows",
          flush=True)

    def tiled(x, w, y):
        m, k = x.shape
        n = w.shape[0]
        vals = [P(x.data_ptr()), I(1), P(w.data_ptr()), P(y.data_ptr()), I(m), I(n), I(k), I(chunk(k)), P(0)]
        return launcher(fns["tandem_gemm_f32_tiled"], (-(-n // (WARPS * COLS)), -(-m // ROWS), 1), 256, 0, vals,
                        (x, w, y))

    def rowk(x, w, y):
        m, k = x.shape
        n = w.shape[0]
        vals = [P(x.data_ptr()), I(1), P(w.data_ptr()), P(0), L(n * k), P(y.data_ptr()), I(m), I(n),
                I(k), I(chunk(k)), P(0)]
        return launcher(fns["tandem_gemm_f32"], (-(-n // 8), -(-m // 8), 1), 256, 0, vals, (x, w, y))

    gen = torch.Generator(device=DEV).manual_seed(1)
    failures, rows = [], []
    print(f"{'product':>12} {'N x K':>10} {'M':>5} {'tiled us':>9} {'row us':>9} {'x row':>6} {'w %copy':>7}", flush=True)
    for name, n, k in [("router_gate", 256, 7168), ("weights_proj", 64, 7168)]:
        w = torch.rand(n, k, device=DEV, generator=gen) * 2 - 1
        for m in [2, 16, 128, 512, 2048, 4096]:
            x = torch.rand(m, k, device=DEV, generator=gen) * 2 - 1
            a, b = torch.empty(m, n, device=DEV), torch.empty(m, n, device=DEV)
            run(tiled(x, w, a))
            run(rowk(x, w, b))
            if not torch.equal(a.view(torch.int32), b.view(torch.int32)):
                failures.append(f"{name} M = {m}: the kernels' bits differ")
            t, r = timed(tiled(x, w, a), args.reps), timed(rowk(x, w, b), args.reps)
            rows.append({"product": name, "n": n, "k": k, "m": m, "tiled_ms": t, "row_ms": r,
                         "weight_of_copy": n * k * 4 / t / 1e6 / copy})
            print(f"{name:>12} {n:>4}x{k:<5} {m:>5} {t * 1e3:9.1f} {r * 1e3:9.1f} {r / t:6.1f} "
                  f"{100 * rows[-1]['weight_of_copy']:6.0f}%", flush=True)
    report(args.json, {"device": torch.cuda.get_device_name(0), "copy_gbps": copy, "defines": DEFINES, "rows": rows},
           failures)


if __name__ == "__main__":
    main()
