"""Benchmark and checks of the sparse MLA decode kernel (engine/kernels/sparse_mla.cu; issue: sparse MLA decode
at FlashMLA speed) next to the same-run ceilings (device copy, bf16 matmul), a naive PyTorch version and, when
it is importable (built from source in the same device call, bench/gpu/README or ENV-NOTES), FlashMLA.

  python3 bench/gpu/sparse_mla_bench.py [--quick] [--json FILE] [--split-tiles N ...] [--no-check]

Shapes (the issue's): h_q 128, d_qk 576, d_v 512, topk 2048, 64-token blocks, b in 32/64/128, s_q 1 or 2 (the
draft sees one more token), context 8K or 32K, indices uniformly random within each query's causal length,
each request's blocks a random permutation of a paged pool. FLOPs = 2 b s_q h_q topk (576 + 512). Each timed
run follows a 256 MiB L2 flush; times are medians of CUDA-event-timed runs on the default stream (ours: the
decode kernel + the split combine; FlashMLA: its decode + combine with its scheduler metadata prepared once).

Checks (before timing): the SPEC section 6 tolerances against an f32 reference on the dequantized cache (abs
1e-3 or rel 2/128 elementwise, diff <= 5e-6) for the issue's shapes and the edge cases (4 heads, context <
topk, context not a multiple of 64, all indices invalid, length-1 requests, mixed s_q, short selections,
several splits), and batch invariance (one query's output bit-identical at batch 1, 63, 64, 65, 128, 129, for
each split setting: the split setting is a model constant, it changes the order of the sum).

FlashMLA: importable through PYTHONPATH; `scripts/gpu-test.sh run sparse-mla` builds it from FLASHMLA_SRC first.
"""
import argparse
import json
import math
import os
import sys

import numpy as np
import torch

try:
    import cupy as cp
except ImportError:  # pragma: no cover - the GPU machine has CuPy
    sys.exit("sparse_mla_bench.py needs CuPy (installed on the GPU machine)")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_timing import copy_gbps, timed  # noqa: E402
import importlib.util  # noqa: E402

_spec = importlib.util.spec_from_file_location("kernel_loop", os.path.join(ROOT, "scripts", "kernel-loop.py"))
kl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kl)

BLOCK, DQK, DV, ENTRY, TOPK = 64, 576, 512, 656, 2048
SHARED_BYTES = 73728 + 2 * 73728 + 8192 + 512 + 256 + 256 + 48 + 1024
DEV = torch.device("cuda")


def cpa(t):
    """A CuPy view of a torch tensor (bf16 viewed as int16)."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return cp.from_dlpack(t)


class Kernel:
    def __init__(self):
        mod = kl.module("sparse_mla")
        self.decode = mod.get_function("tandem_sparse_mla_decode")
        kl.set_smem(self.decode, SHARED_BYTES)
        # 128 heads (two head blocks): pairs of CTAs sharing each tile's dequantization (a cluster of two).
        self.pair = mod.get_function("tandem_sparse_mla_decode_pair")
        kl.set_smem(self.pair, SHARED_BYTES)
        self.use_pair = True
        self.combine = mod.get_function("tandem_sparse_mla_combine")
        self.ws = {}

    def prepare(self, q, heads, pool, num_blocks, table, query_row, ctx_len, sel, sel_len, split_tiles, scale,
                out, out_bf16=True, lse=None):
        """A launch closure with every argument converted once (nothing but the launches when called, so it
        can be captured into a CUDA graph); runs on torch's current stream."""
        queries, topk = sel.shape
        max_splits = max(1, -(-(-(-topk // BLOCK)) // split_tiles))
        po = torch.empty(queries * max_splits * heads * DV, dtype=torch.float32, device=DEV)
        pl = torch.empty(queries * max_splits * heads, dtype=torch.float32, device=DEV)
        lse_arg = cpa(lse) if lse is not None else np.uint64(0)
        sl = cpa(sel_len) if sel_len is not None else np.uint64(0)
        dargs = (cpa(q), np.int32(heads), cpa(pool), np.int32(num_blocks), cpa(table), np.int32(table.shape[1]),
                 cpa(query_row), cpa(ctx_len), cpa(sel), np.int32(topk), sl, np.int32(split_tiles),
                 np.float32(scale), cpa(out), np.int32(1 if out_bf16 else 0), lse_arg, cpa(po), cpa(pl),
                 np.int32(max_splits))
        cargs = (cpa(po), cpa(pl), np.int32(heads), np.int32(max_splits), sl, np.int32(topk), np.int32(split_tiles),
                 cpa(out), np.int32(1 if out_bf16 else 0), lse_arg)
        grid = (-(-heads // 64), queries, max_splits)

        def launch():
            with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                fn = self.pair if self.use_pair and grid[0] == 2 else self.decode
                fn(grid, (384,), dargs, shared_mem=SHARED_BYTES)
                if max_splits > 1:
                    self.combine((heads, queries), (128,), cargs)
        launch.keep = (po, pl)
        return launch

    def __call__(self, *args, **kw):
        self.prepare(*args, **kw)()


E4M3 = None


def random_pool(num_blocks, gen):
    """num_blocks x 64 entries of 656 bytes, quantized as the engine's cache writer does (SPEC section 4) from
    values drawn like FlashMLA's tests draw them (randn / 10 plus an offset): e4m3 codes of 4 tiles of 128 with
    ue8m0 (power-of-two) scales, then 64 bf16 k_pe."""
    n = num_blocks * BLOCK
    pool = torch.empty(n, ENTRY, dtype=torch.uint8, device=DEV)
    off = (torch.rand(1, device=DEV, generator=gen).item() - 0.5) / 10
    c = (torch.randn(n, 4, 128, device=DEV, generator=gen) / 10 + off)
    amax = c.abs().amax(dim=2, keepdim=True).clamp(min=1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    pool[:, :512] = (c / scale).to(torch.float8_e4m3fn).view(torch.uint8).view(n, 512)
    pool[:, 512:528] = scale.view(n, 4).contiguous().view(torch.uint8).view(n, 16)
    kpe = (torch.randn(n, 64, device=DEV, generator=gen) / 10 + off).to(torch.bfloat16)
    pool[:, 528:] = kpe.view(torch.uint8).view(n, 128)
    return pool


def dequant(pool_rows):
    """[n, 656] u8 -> [n, 576] f32 (c dequantized, then k_pe)."""
    global E4M3
    if E4M3 is None:
        E4M3 = torch.from_numpy(kl.e4m3_values()).to(DEV)  # the generator never draws NaN codes
    n = pool_rows.shape[0]
    c = E4M3[pool_rows[:, :512].long()].view(n, 4, 128)
    sc = pool_rows[:, 512:528].contiguous().view(torch.float32).view(n, 4, 1)
    kpe = pool_rows[:, 528:].contiguous().view(torch.bfloat16).float()
    return torch.cat([(c * sc).view(n, 512), kpe], dim=1)


class Case:
    """b requests, s_q queries each; query j of a request sees ctx + j tokens (unless `ctxs` gives them)."""

    def __init__(self, b, s_q, ctx, heads=128, topk=TOPK, seed=0, ctxs=None, sel_lens=None, invalid_frac=0.0):
        gen = torch.Generator(device=DEV)
        gen.manual_seed(seed)
        rng = np.random.default_rng(seed)
        self.b, self.s_q, self.heads, self.topk = b, s_q, heads, topk
        qn = b * s_q
        if ctxs is None:
            ctxs = [ctx + j for _ in range(b) for j in range(s_q)]
        self.ctxs = ctxs
        maxctx = max(max(ctxs), 1)
        nblk = -(-maxctx // BLOCK)
        self.num_blocks = b * nblk
        self.pool = random_pool(self.num_blocks, gen)
        tab = rng.permutation(self.num_blocks).reshape(b, nblk).astype(np.int32)
        self.table = torch.from_numpy(tab).to(DEV)
        self.query_row = torch.tensor([r for r in range(b) for _ in range(s_q)], dtype=torch.int32, device=DEV)
        self.ctx_len = torch.tensor(ctxs, dtype=torch.int32, device=DEV)
        sel = np.full((qn, topk), -1, dtype=np.int32)
        for i, c in enumerate(ctxs):
            k = min(c, topk)
            if k:
                pos = np.sort(rng.choice(c, size=k, replace=False)) if c > k else np.arange(c)
                sel[i, :k] = pos
        if invalid_frac:
            mask = rng.random(sel.shape) < invalid_frac
            sel[mask] = -1
        self.sel = torch.from_numpy(sel).to(DEV)
        self.sel_len = torch.tensor(sel_lens, dtype=torch.int32, device=DEV) if sel_lens is not None else None
        self.q = (torch.randn(qn, heads, DQK, device=DEV, generator=gen)).to(torch.bfloat16)
        self.scale = 1.0 / math.sqrt(DQK)
        tabl = self.table.long()
        rows = self.query_row.long()
        s = self.sel.long()
        blk = tabl[rows[:, None].expand_as(s), (s.clamp(min=0) // BLOCK)]
        self.global_idx = torch.where(s >= 0, blk * BLOCK + s.clamp(min=0) % BLOCK, torch.full_like(s, -1)).int()

    def reference(self):
        """f32 attention over the dequantized cache: [queries, heads, 512], and lse [queries, heads]."""
        outs, lses = [], []
        for i in range(self.sel.shape[0]):
            n = self.topk if self.sel_len is None else max(0, min(int(self.sel_len[i]), self.topk))
            s = self.sel[i, :n].long()
            g = self.global_idx[i, :n].long()
            ok = (s >= 0) & (s < self.ctx_len[i])
            g = g[ok]
            if g.numel() == 0:
                outs.append(torch.zeros(self.heads, DV, device=DEV))
                lses.append(torch.full((self.heads,), float("-inf"), device=DEV))
                continue
            kv = dequant(self.pool[g])
            logits = (self.q[i].float() @ kv.t()) * self.scale
            lse = torch.logsumexp(logits, dim=1)
            outs.append(torch.softmax(logits, dim=1) @ kv[:, :DV])
            lses.append(lse)
        return torch.stack(outs), torch.stack(lses)

    def run(self, kern, split_tiles, out_bf16=True):
        qn = self.sel.shape[0]
        out = torch.full((qn, self.heads, DV), float("nan"), device=DEV,
                         dtype=torch.bfloat16 if out_bf16 else torch.float32)
        lse = torch.full((qn, self.heads), float("nan"), device=DEV)
        kern(self.q, self.heads, self.pool, self.num_blocks, self.table, self.query_row, self.ctx_len, self.sel,
             self.sel_len, split_tiles, self.scale, out, out_bf16, lse)
        return out, lse


def check(name, out, lse, ref, ref_lse, failures):
    o = out.float()
    bad_nan = bool(torch.isnan(o).any())
    err = (o - ref).abs()
    rel = err / ref.abs().clamp(min=1e-30)
    elem_ok = bool(((err < 1e-3) | (rel < 2.0 / 128)).all())
    den = (o * o + ref * ref).sum().item()
    diff = 0.0 if den == 0 else 1 - 2 * (o * ref).sum().item() / den
    fin = torch.isfinite(ref_lse)
    lse_ok = bool((torch.isfinite(lse) == fin).all()) and bool(((lse - ref_lse)[fin].abs() < 1e-3).all())
    ok = elem_ok and diff <= 5e-6 and not bad_nan and lse_ok
    print(f"  check {name:<44} max abs err {err.max().item():.2e}  diff {diff:.2e}  lse {'ok' if lse_ok else 'BAD'}"
          f"  {'ok' if ok else 'FAIL'}")
    if not ok:
        failures.append(name)
    return ok


def checks(kern, split_default):
    failures = []
    print("checks (SPEC section 6 tolerances against an f32 reference on the dequantized cache):")
    cases = [
        ("b=4 s_q=1 ctx=8192", Case(4, 1, 8192, seed=1), [split_default]),
        ("b=3 s_q=2 ctx=4100 (draft sees +1)", Case(3, 2, 4100, seed=2), [split_default, 4, 1000]),
        ("4 heads (tiny model), ctx=300 < topk", Case(2, 2, 300, heads=4, seed=3), [split_default, 1]),
        ("ctx=1 (length-1 requests)", Case(3, 1, 1, seed=4), [split_default]),
        ("ctx=0 (nothing selected: zeros)", Case(2, 1, 0, seed=5), [split_default]),
        ("mixed contexts and s_q", Case(3, 1, 0, seed=6, ctxs=[70, 2049, 5000]), [split_default, 2]),
        ("half the indices -1", Case(2, 2, 9000, seed=7, invalid_frac=0.5), [split_default, 3]),
        ("all indices -1", Case(2, 1, 3000, seed=8, invalid_frac=1.0), [split_default, 2]),
        ("sel_len shorter than topk", Case(3, 1, 5000, seed=9, sel_lens=[0, 100, 1500]), [split_default, 2]),
        ("192 heads (3 head blocks)", Case(2, 1, 2500, heads=192, seed=10), [split_default]),
    ]
    for name, case, splits in cases:
        ref, ref_lse = case.reference()
        for st in splits:
            for bf in (True, False):
                out, lse = case.run(kern, st, out_bf16=bf)
                check(f"{name}, split {st}, {'bf16' if bf else 'f32'}", out, lse, ref, ref_lse, failures)
    # The pair form (128 heads: two CTAs sharing each tile's dequantization) and the single form: same bits.
    case = Case(3, 2, 5000, seed=12)
    use = kern.use_pair
    outs = []
    for pair in (True, False):
        kern.use_pair = pair
        outs.append(case.run(kern, split_default, out_bf16=False)[0].view(torch.int32).clone())
    kern.use_pair = use
    same = bool((outs[0] == outs[1]).all())
    print(f"  pair form vs single form: {'identical' if same else 'DIFFERENT'}")
    if not same:
        failures.append("pair vs single")
    # Batch invariance: query 0 of a fixed request, inside batches of every size around the launch's edges.
    print("batch invariance (query 0's output bits at each batch size, split setting fixed):")
    base = Case(1, 2, 6000, seed=11)
    for st in sorted({split_default, 4}):
        ref_bits = None
        for b in (1, 63, 64, 65, 128, 129):
            big = Case(b, 2, 6000, seed=100 + b)
            # Put the fixed request at row b // 2 (its pool blocks appended at the end of the pool).
            nb = big.num_blocks
            big.pool = torch.cat([big.pool, base.pool])
            big.num_blocks = nb + base.num_blocks
            r = b // 2
            big.table[r] = base.table[0] + nb
            big.q[2 * r:2 * r + 2] = base.q
            big.sel[2 * r:2 * r + 2] = base.sel
            big.ctx_len[2 * r:2 * r + 2] = base.ctx_len
            out, _ = big.run(kern, st, out_bf16=False)
            bits = out[2 * r:2 * r + 2].view(torch.int32).clone()
            if ref_bits is None:
                ref_bits = bits
            same = bool((bits == ref_bits).all())
            print(f"  split {st} batch {b:>3}: {'identical' if same else 'DIFFERENT'}")
            if not same:
                failures.append(f"batch invariance split {st} b {b}")
    return failures


def ceilings():
    copy = copy_gbps()
    m = 8192
    x = torch.randn(m, m, device=DEV, dtype=torch.bfloat16)
    y = torch.randn(m, m, device=DEV, dtype=torch.bfloat16)
    mm = 2 * m ** 3 / timed(lambda: x @ y, 10, graph=False) / 1e9
    return copy, mm


def naive(case):
    """Gather, dequantize, two bmm (bf16)."""
    g = case.global_idx.long().clamp(min=0)
    qn = g.shape[0]
    kv = dequant(case.pool[g.view(-1)]).view(qn, case.topk, DQK).to(torch.bfloat16)
    logits = torch.bmm(case.q, kv.transpose(1, 2)).float() * case.scale
    p = torch.softmax(logits, dim=-1).to(torch.bfloat16)
    return torch.bmm(p, kv[:, :, :DV])


def flashmla():
    try:
        import flash_mla  # noqa: F401
        return flash_mla
    except Exception as e:  # noqa: BLE001
        print("FlashMLA not importable:", e)
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--split-tiles", type=int, nargs="+", default=[32])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--no-pair", action="store_true", help="128 heads as two independent CTAs (no cluster)")
    a = ap.parse_args()
    dev = torch.cuda.get_device_name()
    kern = Kernel()
    kern.use_pair = not a.no_pair
    failures = [] if a.no_check else checks(kern, a.split_tiles[0])
    copy, mm = ceilings()
    print(f"{dev}: device copy {copy:.0f} GB/s, bf16 matmul {mm:.0f} TFLOPS (8192^3)")
    fm = flashmla()
    rows = []
    shapes = [(b, s, c) for c in (8192, 32768) for s in (1, 2) for b in (32, 64, 128)]
    if a.quick:
        shapes = [(64, 1, 32768), (64, 2, 32768)]
    hdr = f"{'b':>4} {'s_q':>3} {'ctx':>6} {'split':>5} {'ours us':>8} {'TFLOPS':>7} {'GB/s':>6} {'FlashMLA us':>11} {'TFLOPS':>7} {'ratio':>6} {'naive TF':>8}"
    lines = []
    for (b, s_q, ctx) in shapes:
        case = Case(b, s_q, ctx, seed=b * 10 + s_q)
        flops = 2 * b * s_q * 128 * TOPK * (DQK + DV)
        nbytes = b * s_q * TOPK * ENTRY + case.q.numel() * 2 + b * s_q * 128 * DV * 2
        qn = b * s_q
        out = torch.empty(qn, 128, DV, device=DEV, dtype=torch.bfloat16)
        fm_us = None
        if fm is not None:
            kc = case.pool.view(case.num_blocks, BLOCK, 1, ENTRY)
            qf = case.q.view(b, s_q, 128, DQK)
            idx = case.global_idx.view(b, s_q, TOPK)
            meta = fm.get_mla_metadata()[0]
            fm_out, _ = fm.flash_mla_with_kvcache(qf, kc, None, None, DV, meta, None, softmax_scale=case.scale,
                                                  is_fp8_kvcache=True, indices=idx)
            fm_us = 1e3 * timed(lambda: fm.flash_mla_with_kvcache(qf, kc, None, None, DV, meta, None,
                                                                   softmax_scale=case.scale, is_fp8_kvcache=True,
                                                                   indices=idx), a.reps)
        naive_tf = None
        if b == 64 and not a.quick:
            try:
                naive_tf = flops / (1e-3 * timed(lambda: naive(case), 3, graph=False)) / 1e12
            except torch.cuda.OutOfMemoryError:
                naive_tf = None
        for st in a.split_tiles:
            launch = kern.prepare(case.q, 128, case.pool, case.num_blocks, case.table, case.query_row, case.ctx_len,
                                  case.sel, None, st, case.scale, out, True, None)
            us = 1e3 * timed(launch, a.reps)
            if fm is not None and st == a.split_tiles[0]:
                ours, _ = case.run(kern, st)
                d = (ours.float() - fm_out.view(qn, 128, DV).float()).abs().max().item()
                print(f"  b={b} s_q={s_q} ctx={ctx}: max |ours - FlashMLA| = {d:.2e}")
            r = {"batch": b, "s_q": s_q, "context": ctx, "split_tiles": st, "us": us,
                 "tflops": flops / (us * 1e-6) / 1e12, "gb_per_s": nbytes / (us * 1e-6) / 1e9,
                 "flashmla_us": fm_us, "flashmla_tflops": flops / (fm_us * 1e-6) / 1e12 if fm_us else None,
                 "naive_tflops": naive_tf}
            r["ratio"] = r["tflops"] / r["flashmla_tflops"] if fm_us else None
            rows.append(r)
            fmt = lambda v, f: (f % v) if v is not None else "-"  # noqa: E731
            lines.append(f"{b:>4} {s_q:>3} {ctx:>6} {st:>5} {us:>8.1f} {r['tflops']:>7.0f} {r['gb_per_s']:>6.0f} "
                         f"{fmt(fm_us, '%11.1f'):>11} {fmt(r['flashmla_tflops'], '%7.0f'):>7} "
                         f"{fmt(r['ratio'], '%6.2f'):>6} {fmt(naive_tf, '%8.1f'):>8}")
            print(lines[-1], flush=True)
        del case
        torch.cuda.empty_cache()
    print()
    print(hdr)
    print("\n".join(lines))
    finish(a.json, dev, copy, mm, failures, rows)


def finish(json_path, dev, copy, mm, failures, rows):
    """Reports failed checks, writes the JSON (device, same-run ceilings, rows) and exits non-zero on failure."""
    if failures:
        print("FAILED checks:", failures)
    if json_path:
        json.dump({"device": dev, "copy_gb_per_s": copy, "bf16_matmul_tflops": mm, "failures": failures,
                   "rows": rows}, open(json_path, "w"), indent=1)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
