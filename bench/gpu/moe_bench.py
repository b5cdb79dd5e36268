"""Benchmark of the grouped FP8 GEMM of the routed experts (issue: FP8 GEMMs and MoE): engine/kernels/gemm.cu's
grouped products (engine::cuda::moe) next to the same-run copy bandwidth and the same kernel's plain product
of one expert's M, N, K.

  python3 bench/gpu/moe_bench.py [--quick] [--json FILE]

DeepSeek-V3.2's expert matrices (gate and up: N 2048 x K 7168; down: N 7168 x K 2048) over E local experts
(8, and 32: one rank of EP-8), every expert with m tokens (m = 1..1024; the row tiles of a grouped launch
are listed on the device as the engine's planning kernel lists them: an expert's rows contiguous, tiles of
up to 64 rows where the experts average at most 64 pairs, else 128, none padded; the 64-row cases are also
timed with 128-row tiles). Each timing is a CUDA graph replay after a 256 MiB read that evicts the L2,
median of the runs; f32 output as in the engine. Figures of merit (issue targets):
  - m < 256: weight GB/s = E N K (+ scales) / time, against the same-run copy bandwidth (>= 80%);
  - m >= 256: E x (time of the plain product at M = m) / (grouped time) (>= 0.9).

Before timing, the script checks that every grouped row equals the plain product of its expert bit for bit
(the engine's batch-invariance rule; the Rust GPU test checks the same with partial tiles and blocks).
"""
import argparse
import ctypes
import json
import os
import sys

try:
    import torch
except ImportError:  # pragma: no cover - the GPU machine has PyTorch
    sys.exit("moe_bench.py needs PyTorch (installed on the GPU machine)")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemm_bench import (BM, BK, DEV, Gemm, as_u8, check, quant_act, quant_weight, scale_map,  # noqa: E402
                        smem_bytes, tensor_map, threads, transposed_scales, _cuda)
from torch_timing import copy_gbps, timed  # noqa: E402

SHAPES = [("expert_gate", 2048, 7168), ("expert_down", 7168, 2048)]
EXPERTS = [8, 32]
MS = [1, 4, 16, 64, 128, 256, 512, 1024]


def chains(n, kpad):
    """engine::cuda::gemm::chains."""
    pairs = max(1, (-(-n // 64) + 1) // 2)
    return min(max(1, min(16, (132 // 2) // pairs)), max(1, kpad // BK))


def tile_rows(counts):
    """engine::cuda::moe::tile_rows: 64-row tiles where the experts average at most 64 pairs."""
    return 64 if sum(counts) <= 64 * len(counts) else BM


def row_tiles(counts, rows):
    """The device's tile list (tandem_moe_plan) in tiles of `rows`: [slots, 3] i32 of {first row, expert, end
    row}, plus the slot count the engine sizes the launch for (engine::cuda::moe::tile_slots)."""
    tiles, row = [], 0
    for e, c in enumerate(counts):
        for m0 in range(row, row + c, rows):
            tiles.append((m0, e, row + c))
        row += c
    pairs = sum(counts)
    slots = -(-pairs // rows) + min(len(counts), pairs)
    tiles += [(0, -1, 0)] * (slots - len(tiles))
    return torch.tensor(tiles, device=DEV, dtype=torch.int32).contiguous(), slots


class Grouped:
    def __init__(self, gemm):
        self.g = gemm

    def prepare(self, qa, sa, w, ws, counts, n, y, bn=None, tiles=None, rows=None):
        """A launch closure of the grouped product: qa [P, kpad] rows grouped by expert (counts), w [E * n,
        kpad] stacked experts with scales ws [E * ceil(n / 128), kpad / 128]; f32 y [P, n]."""
        p, kpad = qa.shape
        e = len(counts)
        rows = rows or tile_rows(counts)
        t, slots = tiles if tiles is not None else row_tiles(counts, rows)
        bn = bn or self.g.tile_n(slots * rows, n)  # engine::cuda::moe::grouped_linear
        sa_t = transposed_scales(sa)
        ta, tb, tsa = tensor_map(qa, p, kpad, rows // 2), tensor_map(w, e * n, kpad, bn), scale_map(sa_t, p)
        fn = self.g.fns[(rows, bn, "f32", chains(n, kpad) > 1)]
        vals = [ta, tb, tsa, ta, ctypes.c_uint64(ws.data_ptr()), ctypes.c_int32(ws.shape[1]),  # no output map
                ctypes.c_uint64(y.data_ptr()), ctypes.c_uint64(0), ctypes.c_int32(chains(n, kpad)),
                ctypes.c_int32(p), ctypes.c_int32(n), ctypes.c_int32(kpad), ctypes.c_uint64(t.data_ptr()),
                ctypes.c_int32(slots), ctypes.c_uint64(0),  # no output row map
                ctypes.c_int32(0)]  # register stores: a grouped tile's rows end at its expert's
        params = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in vals])
        units = slots * ((-(-n // bn) + 1) // 2)
        grid = 2 * min(units, self.g.sms // 2)
        keep = (vals, params, qa, sa_t, w, ws, y, t)

        def launch():
            stream = torch.cuda.current_stream().cuda_stream
            check(_cuda.cuLaunchKernel(fn, grid, 1, 1, threads(rows), 1, 1, smem_bytes(rows, bn, "f32"), ctypes.c_void_p(stream), params,
                                       None), "grouped gemm")
        launch.keep = keep
        return launch


def experts(e, n, k, gen):
    """E expert matrices [n, k], quantized and stacked as the loader stacks them."""
    qs, ss = [], []
    for _ in range(e):
        q, s = quant_weight(torch.randn(n, k, device=DEV, generator=gen) * (1.0 / k ** 0.5))
        qs.append(q)
        ss.append(s)
    return torch.cat(qs).contiguous(), torch.cat(ss).contiguous(), qs, ss


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="E 8 only, m 1, 64, 256, 1024")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    gemm = Gemm()
    grouped = Grouped(gemm)
    gen = torch.Generator(device=DEV).manual_seed(0)
    copy = copy_gbps()
    ms = MS if not args.quick else [1, 64, 256, 1024]
    es = EXPERTS if not args.quick else [8]
    print(f"copy bandwidth {copy:.0f} GB/s")

    # Check: grouped rows == each expert's plain product, bit for bit (uneven counts, both tile widths).
    n, k = 2048, 7168
    counts = [0, 1, 127, 128, 129, 300]
    qw, sw, qs, ss = experts(len(counts), n, k, gen)
    x = torch.randn(sum(counts), k, device=DEV, generator=gen)
    qa, sa = quant_act(x)
    for rows, bn in ((64, 64), (64, 128), (BM, 64), (BM, 128)):
        y = torch.zeros(sum(counts), n, device=DEV)
        grouped.prepare(as_u8(qa), sa, as_u8(qw), sw, counts, n, y, bn=bn, rows=rows)()
        row = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            yp = torch.zeros(c, n, device=DEV)
            gemm.prepare(as_u8(qa[row:row + c].contiguous()), sa[row:row + c].contiguous(), as_u8(qs[e]), ss[e],
                         yp, bn, False)()
            if not torch.equal(y[row:row + c].view(torch.int32), yp.view(torch.int32)):
                sys.exit(f"check failed: expert {e} ({c} rows), tile {rows}x{bn}: grouped rows differ from the plain "
                         "product")
            row += c
    print("check: grouped rows equal each expert's plain product bit for bit (tiles 64 and 128 rows, 64 and 128 "
          "wide)")

    results = []
    print(f"{'shape':<12} {'E':>3} {'m':>5} {'grouped us':>11} {'weight GB/s':>11} {'of copy':>8} "
          f"{'plain us':>9} {'E*plain/grouped':>15}")
    for name, n, k in SHAPES:
        for e in es:
            qw, sw, qs, ss = experts(e, n, k, gen)
            wbytes = e * n * k + sw.numel() * 4
            for m in ms:
                x = torch.randn(e * m, k, device=DEV, generator=gen)
                qa, sa = quant_act(x)
                y = torch.empty(e * m, n, device=DEV)
                t = 1e3 * timed(grouped.prepare(as_u8(qa), sa, as_u8(qw), sw, [m] * e, n, y), args.reps)  # us
                # 128-row tiles where the engine takes 64 (same bits): what the decode tile gains.
                t128 = 1e3 * timed(grouped.prepare(as_u8(qa), sa, as_u8(qw), sw, [m] * e, n, y, rows=BM), args.reps) \
                    if tile_rows([m] * e) != BM else None
                yp = torch.empty(m, n, device=DEV)
                tp = 1e3 * timed(gemm.prepare(as_u8(qa[:m].contiguous()), sa[:m].contiguous(), as_u8(qs[0]), ss[0],
                                              yp), args.reps)
                gbps = wbytes / t / 1e3  # bytes per us = MB/s; / 1e3 = GB/s
                ratio = e * tp / t
                print(f"{name:<12} {e:>3} {m:>5} {t:>11.1f} {gbps:>11.0f} {gbps / copy:>8.2f} {tp:>9.1f} "
                      f"{ratio:>15.2f}" + (f"   128-row tiles {t128:.1f} us ({wbytes / t128 / 1e3 / copy:.2f})"
                                            if t128 else ""))
                results.append({"shape": name, "n": n, "k": k, "experts": e, "m_per_expert": m, "grouped_us": t,
                                "weight_gbps": gbps, "of_copy": gbps / copy, "plain_us": tp,
                                "e_plain_over_grouped": ratio, "tile_rows": tile_rows([m] * e),
                                "grouped_128_rows_us": t128})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbps": copy, "device": torch.cuda.get_device_name(0),
                       "flush": "write" if os.environ.get("TANDEM_FLUSH") == "write" else "read", "results": results},
                      f, indent=1)


if __name__ == "__main__":
    main()
