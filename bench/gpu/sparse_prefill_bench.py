"""Benchmark and checks of the sparse MLA prefill forms (engine/kernels/sparse_mla.cu; issue: prefill attention
at FlashMLA speed) next to FlashMLA's sparse prefill (`flash_mla_sparse_fwd`, built from source in the same
device call) and the same-run ceilings.

  python3 bench/gpu/sparse_prefill_bench.py [--quick] [--json FILE] [--reps N]

Sparse shapes (FlashMLA's own benchmark's): one request, a chunk of s_q = 4096 tokens at the end of a context of
8K..128K tokens (query j sees ctx - 4096 + j + 1 positions), h_q 128, d_qk 576, d_v 512, top-k 2048 positions
drawn uniformly within each query's causal length, the context in a paged FP8 pool over a random block table.
FLOPs = 2 s_q h_q topk (576 + 512). Each timed run is a CUDA-graph replay after a 256 MiB L2 flush, median.

  - staged:  tandem_sparse_mla_stage over the whole context (FP8 entries -> bf16 rows, once per layer) plus
             tandem_sparse_mla_prefill over the rows (copied into FlashMLA's swizzled K/V tile layout): the CUDA
             backend's FP8 prefill form. The stage is inside the measured time (the issue: any dequantization is).
  - gather:  tandem_sparse_mla_decode_pair over the FP8 pool, each query gathering and dequantizing its own
             entries (the backend's form before the staged one, and decode's).
  - FlashMLA: flash_mla_sparse_fwd over the context in bf16 (its input format; the exact dequantized values).

Dense shapes (contexts within top-k: every position selected): prompts of 1024..2048 tokens, query j attends to
positions 0..j; FLOPs = sum_j 2 h_q (j + 1) (576 + 512). Ours is the staged form with the selections 0..j;
next to it PyTorch's scaled_dot_product_attention (causal) on the same bf16 values.

Checks: staged == gather bit for bit (outputs and lse) on every sparse shape; max |ours - FlashMLA| (bf16).
"""
import argparse
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sparse_mla_bench as smb  # noqa: E402
from torch_timing import copy_gbps, timed  # noqa: E402

cp, kl = smb.cp, smb.kl
BLOCK, DQK, DV, TOPK, HEADS = 64, 576, 512, 2048, 128
DEV = torch.device("cuda")


class Forms:
    def __init__(self):
        mod = kl.module("sparse_mla")
        self.pair = mod.get_function("tandem_sparse_mla_decode_pair")
        self.prefill = mod.get_function("tandem_sparse_mla_prefill")
        self.stage = mod.get_function("tandem_sparse_mla_stage")
        for f in (self.pair, self.prefill):
            kl.set_smem(f, smb.SHARED_BYTES)


class Chunk:
    """s_q queries at the end of a ctx-token context (or the dense causal case: s_q == ctx, all selected)."""

    def __init__(self, ctx, s_q, dense=False, seed=0):
        gen = torch.Generator(device=DEV)
        gen.manual_seed(seed)
        rng = np.random.default_rng(seed)
        self.ctx, self.s_q = ctx, s_q
        nblk = -(-ctx // BLOCK)
        self.num_blocks = nblk + 7
        self.pool = smb.random_pool(self.num_blocks, gen)
        self.table = torch.from_numpy(rng.permutation(self.num_blocks)[:nblk].astype(np.int32)).to(DEV)
        lens = np.arange(ctx - s_q + 1, ctx + 1, dtype=np.int32)
        self.ctx_len = torch.from_numpy(lens).to(DEV)
        # Each query's top-k: uniformly random distinct positions below its length (the top-k of random scores,
        # drawn on the GPU in slices of rows), ascending, -1 past the length where it is at most TOPK.
        sel = torch.full((s_q, TOPK), -1, dtype=torch.int32, device=DEV)
        lens_d = torch.from_numpy(lens).to(DEV)
        pos = torch.arange(ctx, device=DEV)
        for r0 in range(0, s_q, 512):
            r1 = min(r0 + 512, s_q)
            score = torch.rand(r1 - r0, ctx, device=DEV, generator=gen)
            score = torch.where(pos[None, :] < lens_d[r0:r1, None], score, torch.full_like(score, -1.0))
            k = min(TOPK, ctx)
            top = torch.topk(score, k, dim=1)
            idx = torch.where(top.values >= 0, top.indices, torch.full_like(top.indices, ctx + 1))
            idx = torch.sort(idx, dim=1).values
            sel[r0:r1, :k] = torch.where(idx <= ctx, idx, torch.full_like(idx, -1)).int()
            del score, top, idx
        self.sel = sel
        self.sel_len = torch.from_numpy(np.minimum(lens, TOPK).astype(np.int32)).to(DEV)
        self.q = torch.randn(s_q, HEADS, DQK, device=DEV, generator=gen).to(torch.bfloat16)
        self.scale = 1.0 / math.sqrt(DQK)
        # Every query reads the request's one table row; the staged rows are the context in position order.
        self.query_row = torch.zeros(s_q, dtype=torch.int32, device=DEV)
        self.table2d = self.table.view(1, nblk)
        pos = torch.arange(ctx, device=DEV)
        self.slots = (self.table.long()[pos // BLOCK] * BLOCK + pos % BLOCK).contiguous()
        self.row_base = torch.zeros(s_q, dtype=torch.int32, device=DEV)
        self.staged = torch.empty(ctx, DQK, dtype=torch.int16, device=DEV)
        self.dense = dense
        if dense:
            self.flops = sum(2 * HEADS * (j + 1) * (DQK + DV) for j in range(ctx - s_q, ctx))
        else:
            self.flops = 2 * s_q * HEADS * TOPK * (DQK + DV)

    def kv_bf16(self):
        """The context's values (c * scale, k_pe) as bf16 [ctx, 1, 576] in position order (exact)."""
        return smb.dequant(self.pool[self.slots]).to(torch.bfloat16).view(self.ctx, 1, DQK)

    def launches(self, forms, out, lse):
        """(staged, gather) launch closures writing `out` (bf16 [s_q, 128, 512]) and `lse`."""
        one = np.uint64(0)
        common = lambda latent, nb, table, mb, qrow: (  # noqa: E731
            smb.cpa(self.q), np.int32(HEADS), latent, np.int32(nb), table, np.int32(mb), qrow, smb.cpa(self.ctx_len),
            smb.cpa(self.sel), np.int32(TOPK), smb.cpa(self.sel_len), np.int32(32), np.float32(self.scale),
            smb.cpa(out), np.int32(1), smb.cpa(lse), one, one, np.int32(1))
        staged_args = common(smb.cpa(self.staged), self.ctx, one, 0, smb.cpa(self.row_base))
        gather_args = common(smb.cpa(self.pool), self.num_blocks, smb.cpa(self.table2d), self.table2d.shape[1],
                             smb.cpa(self.query_row))
        stage_args = (smb.cpa(self.pool), np.int32(self.num_blocks), smb.cpa(self.slots), np.int32(self.ctx),
                      smb.cpa(self.staged))

        def staged():
            with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                forms.stage((-(-self.ctx // 4),), (256,), stage_args)
                forms.prefill((2, self.s_q, 1), (384,), staged_args, shared_mem=smb.SHARED_BYTES)

        def gather():
            with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                forms.pair((2, self.s_q, 1), (384,), gather_args, shared_mem=smb.SHARED_BYTES)
        return staged, gather


def sdpa(chunk):
    """PyTorch's causal attention over the same bf16 values (the dense shapes' naive baseline)."""
    kv = chunk.kv_bf16().view(1, 1, chunk.ctx, DQK)
    q = chunk.q.view(1, chunk.s_q, HEADS, DQK).transpose(1, 2)
    k = kv.expand(1, HEADS, chunk.ctx, DQK)
    v = kv[..., :DV].expand(1, HEADS, chunk.ctx, DV)
    return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=chunk.scale)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--profile-once", type=int, metavar="CTX",
                    help="run each sparse form once at this context (for Nsight Compute) and exit")
    a = ap.parse_args()
    dev = torch.cuda.get_device_name()
    forms = Forms()
    if a.profile_once:
        ch = Chunk(a.profile_once, 4096, seed=1)
        out = torch.empty(ch.s_q, HEADS, DV, dtype=torch.bfloat16, device=DEV)
        lse = torch.empty(ch.s_q, HEADS, dtype=torch.float32, device=DEV)
        for f in ch.launches(forms, out, lse):
            f()
        fm = smb.flashmla()
        if fm is not None:
            fm.flash_mla_sparse_fwd(ch.q, ch.kv_bf16(), ch.sel.view(ch.s_q, 1, TOPK), ch.scale, DV)
        torch.cuda.synchronize()
        return
    copy = copy_gbps()
    m = 8192
    x = torch.randn(m, m, device=DEV, dtype=torch.bfloat16)
    mm = 2 * m ** 3 / timed(lambda: x @ x, 10, graph=False) / 1e9
    del x
    print(f"{dev}: device copy {copy:.0f} GB/s, bf16 matmul {mm:.0f} TFLOPS (8192^3)", flush=True)
    fm = smb.flashmla()
    failures, rows, lines = [], [], []
    ctxs = [8192, 32768] if a.quick else [8192, 32768, 65536, 131072]
    for ctx in ctxs:
        ch = Chunk(ctx, 4096, seed=ctx // 1024)
        out = torch.empty(ch.s_q, HEADS, DV, dtype=torch.bfloat16, device=DEV)
        out2 = torch.empty_like(out)
        lse = torch.empty(ch.s_q, HEADS, dtype=torch.float32, device=DEV)
        lse2 = torch.empty_like(lse)
        staged, _ = ch.launches(forms, out, lse)
        _, gather = ch.launches(forms, out2, lse2)
        staged()
        gather()
        torch.cuda.synchronize()
        same = torch.equal(out.view(torch.int16), out2.view(torch.int16)) and torch.equal(lse, lse2)
        if not same:
            failures.append(f"ctx {ctx}: staged != gather")
        us_staged = 1e3 * timed(staged, a.reps)
        us_gather = 1e3 * timed(gather, a.reps)
        fm_us, diff = None, None
        if fm is not None:
            kv = ch.kv_bf16()
            idx = ch.sel.view(ch.s_q, 1, TOPK)
            fo = fm.flash_mla_sparse_fwd(ch.q, kv, idx, ch.scale, DV)[0]
            diff = (fo.float() - out.float()).abs().max().item()
            fm_us = 1e3 * timed(lambda: fm.flash_mla_sparse_fwd(ch.q, kv, idx, ch.scale, DV), a.reps)
            del kv, fo
        tf = lambda us: ch.flops / (us * 1e-6) / 1e12 if us else None  # noqa: E731
        r = {"kind": "sparse", "context": ctx, "s_q": ch.s_q, "staged_us": us_staged, "staged_tflops": tf(us_staged),
             "gather_us": us_gather, "gather_tflops": tf(us_gather), "flashmla_us": fm_us,
             "flashmla_tflops": tf(fm_us), "max_diff_vs_flashmla": diff, "staged_equals_gather": same}
        r["ratio"] = r["staged_tflops"] / r["flashmla_tflops"] if fm_us else None
        rows.append(r)
        f = lambda v, p: (p % v) if v is not None else "-"  # noqa: E731
        lines.append(f"sparse ctx {ctx:>6} s_q {ch.s_q}: staged {us_staged:8.0f} us {tf(us_staged):5.0f} TF | gather "
                     f"{us_gather:8.0f} us {tf(us_gather):5.0f} TF | FlashMLA {f(fm_us, '%8.0f')} us "
                     f"{f(tf(fm_us), '%5.0f')} TF | ratio {f(r['ratio'], '%.2f')} | same bits {same} | "
                     f"diff {f(diff, '%.1e')}")
        print(lines[-1], flush=True)
        del ch, out, out2, lse, lse2
        torch.cuda.empty_cache()
    for ctx in ([2048] if a.quick else [1024, 1536, 2048]):
        ch = Chunk(ctx, ctx, dense=True, seed=ctx)
        out = torch.empty(ch.s_q, HEADS, DV, dtype=torch.bfloat16, device=DEV)
        lse = torch.empty(ch.s_q, HEADS, dtype=torch.float32, device=DEV)
        staged, _ = ch.launches(forms, out, lse)
        us = 1e3 * timed(staged, a.reps)
        ref = sdpa(ch)
        sd_us, diff = None, None
        try:
            so = ref()
            diff = (so.transpose(1, 2).reshape(ch.s_q, HEADS, DV).float() - out.float()).abs().max().item()
            sd_us = 1e3 * timed(ref, a.reps)
        except RuntimeError as e:  # noqa: BLE001 - report and go on
            print("SDPA failed:", e)
        tf = lambda us: ch.flops / (us * 1e-6) / 1e12 if us else None  # noqa: E731
        r = {"kind": "dense", "context": ctx, "s_q": ch.s_q, "staged_us": us, "staged_tflops": tf(us),
             "sdpa_us": sd_us, "sdpa_tflops": tf(sd_us), "max_diff_vs_sdpa": diff}
        rows.append(r)
        f = lambda v, p: (p % v) if v is not None else "-"  # noqa: E731
        lines.append(f"dense  ctx {ctx:>6}: staged {us:8.0f} us {tf(us):5.0f} TF | SDPA {f(sd_us, '%8.0f')} us "
                     f"{f(tf(sd_us), '%5.0f')} TF | diff {f(diff, '%.1e')}")
        print(lines[-1], flush=True)
        del ch, out, lse
        torch.cuda.empty_cache()
    print()
    print("\n".join(lines))
    smb.finish(a.json, dev, copy, mm, failures, rows)


if __name__ == "__main__":
    main()
