"""Benchmark of the lightning indexer on the GPU (issue: indexer and top-k): the FP8 scorer
(engine/kernels/indexer.cu) plus the top-k rule (engine/kernels/topk.cu), decode and prefill, next to the
same-run copy bandwidth and a naive PyTorch version.

  python3 bench/gpu/indexer_bench.py [--quick] [--json FILE]

Decode: batch b of requests, s_q query rows each (1, or 2 with an MTP draft that sees one more token), every
request's context over its own random block table in a paged pool of 8448-byte FP8 key blocks; time = scorer
+ top-k, replayed as a CUDA graph (the launches' GPU time, as in a graphed decode step), L2 flushed (a 256 MiB
read; TANDEM_FLUSH=write writes it) before every timed run; bytes = sum of contexts x 132 + q + weights.
Prefill: a chunk of T tokens at the end of a C-token context, scored and selected in row chunks of at most
64 MiB of scores (as the CUDA backend does), groups of 4 rows sharing the request's block table.

Correctness is the Rust tests' (engine::cuda::indexer, engine::cuda::topk); this script checks one decode
shape's scores against an f64 reference and its selections against the NumPy top-k rule before timing.
"""
import argparse
import json
import os
import sys

import numpy as np

try:
    import cupy as cp
except ImportError:  # pragma: no cover - the GPU machine has CuPy
    sys.exit("indexer_bench.py needs CuPy (installed on the GPU machine)")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import importlib.util  # noqa: E402

_spec = importlib.util.spec_from_file_location("kernel_loop", os.path.join(ROOT, "scripts", "kernel-loop.py"))
kl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kl)

BLOCK, DIM, HEADS, K = 64, 128, 64, 2048
BLOCK_BYTES = BLOCK * (DIM + 4)
MAX_Q = 4
SCORE_BYTES = 64 << 20
HIST_WORDS = 2049  # the top-k's first-digit histogram per row, filled by the scorer
# engine::cuda::topk: the split form's slice, plan record words, resolve shared memory and limits.
SLICE, SPLIT_CAP = 4096, 16384
SPLIT_WORDS = 16 + 3 * 64 + SPLIT_CAP
RESOLVE_SMEM = (2048 + 2 * SPLIT_CAP) * 4
MAX_SPLIT_STRIDE, SPLIT_MAX_ROWS = 64 * SLICE, 512


def shared_bytes(max_q):
    return kl.indexer_smem(max_q)


FLUSH = None


# The L2 flush reads 256 MiB (TANDEM_FLUSH=write: writes it, the method before 2026-11-27, which leaves the
# L2 dirty so a kernel reading under a few hundred MB pays write-backs inside its time; bench/gpu/torch_timing.py).
WRITE_FLUSH = os.environ.get("TANDEM_FLUSH") == "write"


def timed(fn, reps, graph=True):
    """Median ms of `reps` replays of `fn` captured as a CUDA graph, each after the L2 is evicted (a 256 MiB
    read, untimed); `graph=False` times eager launches (the copy and the naive PyTorch baseline)."""
    global FLUSH
    if FLUSH is None:
        FLUSH = cp.full(256 << 20, 0x5A, dtype=cp.uint8)
    flush = (lambda: FLUSH.fill(0x5A)) if WRITE_FLUSH else (lambda: FLUSH.max())
    return kl.time_ms(fn, reps, flush=flush, graph=graph)


def copy_bandwidth():
    """Device-to-device copy of 1 GiB: (read + written bytes) / time."""
    n = 1 << 30
    a, b = cp.ones(n, dtype=cp.uint8), cp.empty(n, dtype=cp.uint8)
    ms = timed(lambda: cp.copyto(b, a), 10, graph=False)
    return 2 * n / ms / 1e6


class Kernels:
    def __init__(self):
        self.scores = kl.module("indexer").get_function("tandem_indexer_scores")
        kl.set_smem(self.scores, max(shared_bytes(m) for m in range(1, MAX_Q + 1)))
        mod = kl.module("topk")
        self.topk = mod.get_function("tandem_topk_rule")
        kl.set_smem(self.topk, kl.TOPK_SMEM)
        # The split form (engine::cuda::topk::RawTopk::split): plan, slice scan, resolve, slice emission.
        self.plan = mod.get_function("tandem_topk_split_plan")
        kl.set_smem(self.plan, kl.TOPK_SMEM)
        self.scan = mod.get_function("tandem_topk_split_scan")
        self.resolve = mod.get_function("tandem_topk_split_resolve")
        kl.set_smem(self.resolve, RESOLVE_SMEM)
        self.emit = mod.get_function("tandem_topk_split_emit")

    def score(self, q, w, pool, num_blocks, table, max_blocks, lens, groups, max_q, scores, stride, hist):
        """The scorer; `hist` ([rows, 2049] u32) is zeroed and gets the top-k's first-digit counts."""
        ngroups = groups.size // 2
        hist.fill(0)
        kl.indexer_scores(self.scores, (-(-max_blocks // 8), ngroups), pool, num_blocks,
                          (q, w, np.int32(HEADS), table, np.int32(max_blocks), np.int32(num_blocks), lens, groups,
                           np.int32(max_q), scores, np.int64(stride), hist), shared_bytes(max_q))

    def select(self, scores, stride, lens, rows, pos, counts, nans, hist, plans=None):
        """The top-k; with `plans` ([rows, SPLIT_WORDS] u32) in the split form, as the CUDA backend runs it where
        split_applies."""
        st, kk = np.int64(stride), np.int32(K)
        if plans is None:
            self.topk((rows,), (1024,), (scores, st, lens, kk, pos, counts, nans, hist), shared_mem=kl.TOPK_SMEM)
            return
        slices = (-(-stride // SLICE), rows)
        self.plan((rows,), (1024,), (scores, st, lens, kk, pos, counts, nans, hist, plans), shared_mem=kl.TOPK_SMEM)
        self.scan(slices, (256,), (scores, st, lens, plans))
        self.resolve((rows,), (1024,), (scores, st, lens, kk, pos, counts, nans, plans), shared_mem=RESOLVE_SMEM)
        self.emit(slices, (256,), (scores, st, lens, kk, pos, plans))


def split_possible(rows, stride):
    """Where the split form can run (the bench then times both forms)."""
    return rows <= SPLIT_MAX_ROWS and K < stride <= MAX_SPLIT_STRIDE


def split_applies(rows, stride):
    """engine::cuda::topk::split_applies: where the CUDA backend runs the split form."""
    return split_possible(rows, stride) and (stride >= 16 * SLICE or (stride >= 4 * SLICE and rows <= stride // 512))


def random_pool(num_blocks):
    pool = cp.random.randint(0, 256, size=(num_blocks, BLOCK_BYTES), dtype=cp.int32).astype(cp.uint8)
    pool[(pool & 0x7F) == 0x7F] = 0  # no NaN codes
    scales = cp.exp2(cp.random.randint(-8, 4, size=(num_blocks, BLOCK))).astype(cp.float32)
    pool[:, BLOCK * DIM:] = scales.view(cp.uint8).reshape(num_blocks, BLOCK * 4)
    return pool


def random_q(rows):
    q = cp.random.randint(0, 256, size=(rows, HEADS, DIM), dtype=cp.int32).astype(cp.uint8)
    q[(q & 0x7F) == 0x7F] = 0
    w = (cp.random.random((rows, HEADS), dtype=cp.float32) - 0.3).astype(cp.float32)
    return q, w


def decode_case(kern, rng, b, ctx, s_q, check=False, naive=False, reps=10):
    nblk = -(-(ctx + s_q - 1) // BLOCK)
    num_blocks = b * nblk
    pool = random_pool(num_blocks)
    rows = b * s_q
    tab_req = rng.permutation(num_blocks).reshape(b, nblk).astype(np.int32)
    table = cp.asarray(np.repeat(tab_req, s_q, axis=0))
    lens = cp.asarray(np.array([ctx + j for _ in range(b) for j in range(s_q)], dtype=np.int32))
    groups = cp.asarray(np.array([[r * s_q, s_q] for r in range(b)], dtype=np.int32).reshape(-1))
    q, w = random_q(rows)
    stride = ctx + s_q - 1
    scores = cp.zeros((rows, stride), dtype=cp.float32)
    pos = cp.zeros((rows, K), dtype=cp.int32)
    counts, nans = cp.zeros(rows, dtype=cp.int32), cp.zeros(rows, dtype=cp.int32)

    hist = cp.zeros((rows, HIST_WORDS), dtype=cp.uint32)
    plans = cp.zeros((rows, SPLIT_WORDS), dtype=cp.uint32) if split_possible(rows, stride) else None
    use = plans if split_applies(rows, stride) else None  # the backend's choice

    def run():
        kern.score(q, w, pool, num_blocks, table, nblk, lens, groups, s_q, scores, stride, hist)
        kern.select(scores, stride, lens, rows, pos, counts, nans, hist, use)

    run()
    cp.cuda.runtime.deviceSynchronize()
    res = {"kind": "decode", "batch": b, "context": ctx, "s_q": s_q}
    if check:
        lut = kl.e4m3_values().astype(np.float64)
        hp, ht = cp.asnumpy(pool), cp.asnumpy(table)
        worst, ok = 0.0, True
        for r in (0, rows - 1):
            n = int(cp.asnumpy(lens[r]))
            blocks = hp[ht[r]]
            keys = lut[blocks[:, :BLOCK * DIM].reshape(-1, DIM)][:n]
            ks = blocks[:, BLOCK * DIM:].copy().view(np.float32).reshape(-1).astype(np.float64)[:n]
            qd = lut[cp.asnumpy(q[r])]
            ref = (np.maximum(keys @ qd.T, 0) @ cp.asnumpy(w[r]).astype(np.float64)) * ks
            got = cp.asnumpy(scores[r, :n]).astype(np.float64)
            worst = max(worst, 1 - 2 * (got * ref).sum() / (got * got + ref * ref).sum())
            ok &= bool((cp.asnumpy(pos[r])[:min(n, K)] == kl.topk_reference(cp.asnumpy(scores[r, :n]), K)).all())
        res.update(score_diff=float(worst), selections_equal_rule=bool(ok), ok=bool(ok and worst < 1e-6))
    ms = timed(run, reps)
    res["scores_ms"] = timed(lambda: kern.score(q, w, pool, num_blocks, table, nblk, lens, groups, s_q, scores, stride, hist),
                             reps)
    res["topk_form"] = "split" if use is not None else "single"
    res["topk_ms"] = timed(lambda: kern.select(scores, stride, lens, rows, pos, counts, nans, hist, use), reps)
    if plans is not None:
        # Both forms on the same rows, and whether they select the same (they must: the rule decides).
        res["topk_split_ms"] = timed(lambda: kern.select(scores, stride, lens, rows, pos, counts, nans, hist, plans),
                                     reps)
        split_pos = pos.copy()
        res["topk_single_ms"] = timed(lambda: kern.select(scores, stride, lens, rows, pos, counts, nans, hist), reps)
        res["forms_equal"] = bool((split_pos == pos).all())
        res["ok"] = res.get("ok", True) and res["forms_equal"]
        # The split form's steps, cumulative: plan; + scan; + resolve; (+ emit = topk_ms).
        st, kk, sl = np.int64(stride), np.int32(K), (-(-stride // SLICE), rows)
        plan = lambda: kern.plan((rows,), (1024,), (scores, st, lens, kk, pos, counts, nans, hist, plans),  # noqa: E731
                                 shared_mem=kl.TOPK_SMEM)
        scan = lambda: (plan(), kern.scan(sl, (256,), (scores, st, lens, plans)))  # noqa: E731
        resolve = lambda: (scan(), kern.resolve((rows,), (1024,), (scores, st, lens, kk, pos, counts, nans, plans),  # noqa: E731
                                                shared_mem=RESOLVE_SMEM))
        res["topk_split_steps_ms"] = [timed(f, reps) for f in (plan, scan, resolve)]
    # A request's rows share its keys: each key is read once per request.
    read = b * (ctx + s_q - 1) * (DIM + 4) + q.nbytes + w.nbytes
    flops = 2 * HEADS * DIM * float(cp.asnumpy(lens).astype(np.float64).sum())
    res.update(ms=ms, bytes=read, gb_per_s=read / ms / 1e6, tflops=flops / ms / 1e9)
    if naive:
        res["torch_naive_ms"] = naive_torch(pool, table, q, w, rows, nblk, stride)
    return res


def naive_torch(pool, table, q, w, rows, nblk, stride):
    try:
        import torch
    except ImportError:
        return None
    lut = torch.as_tensor(kl.e4m3_values(), device="cuda")
    tp, tt = torch.as_tensor(pool, device="cuda"), torch.as_tensor(table, device="cuda").long()
    tq, tw = torch.as_tensor(q, device="cuda"), torch.as_tensor(w, device="cuda")

    def run():
        blk = tp[tt]
        kv = lut[blk[..., :BLOCK * DIM].long()].reshape(rows, nblk * BLOCK, DIM)[:, :stride]
        ks = blk[..., BLOCK * DIM:].contiguous().view(torch.float32).reshape(rows, -1)[:, :stride]
        logits = torch.relu(torch.bmm(kv, lut[tq.long()].transpose(1, 2)))
        s = (logits * tw[:, None, :]).sum(-1) * ks
        return torch.topk(s, min(K, stride), dim=1).indices.sort(dim=1)

    try:
        return timed(run, 3, graph=False)
    except Exception as e:  # noqa: BLE001 - out of memory at the largest shapes
        print("naive torch:", e)
        return None


def prefill_case(kern, rng, tokens, ctx, reps=3):
    nblk = -(-ctx // BLOCK)
    pool = random_pool(nblk)
    table_row = rng.permutation(nblk).astype(np.int32)
    first = ctx - tokens
    lens_h = np.arange(first + 1, ctx + 1, dtype=np.int32)
    q, w = random_q(tokens)
    # The CUDA backend's chunking: scores, first-digit counts and (where the split form applies) plan records.
    chunk_of = lambda words: min(tokens, 65535, max(MAX_Q, SCORE_BYTES // (4 * words)))  # noqa: E731
    chunk = chunk_of(ctx + HIST_WORDS + SPLIT_WORDS)
    split = split_applies(chunk, ctx)
    if not split:
        chunk = chunk_of(ctx + HIST_WORDS)
    split_plans = cp.zeros((chunk, SPLIT_WORDS), dtype=cp.uint32) if split else None
    scores = cp.zeros((chunk, ctx), dtype=cp.float32)
    pos = cp.zeros((tokens, K), dtype=cp.int32)
    counts, nans = cp.zeros(tokens, dtype=cp.int32), cp.zeros(tokens, dtype=cp.int32)
    table = cp.asarray(np.tile(table_row, (chunk, 1)))
    lens = cp.asarray(lens_h)
    plans = []
    for r0 in range(0, tokens, chunk):
        n = min(chunk, tokens - r0)
        g = np.array([[i, min(MAX_Q, n - i)] for i in range(0, n, MAX_Q)], dtype=np.int32).reshape(-1)
        plans.append((r0, n, cp.asarray(g)))

    hist = cp.zeros((chunk, HIST_WORDS), dtype=cp.uint32)

    def run():
        for r0, n, g in plans:
            kern.score(q[r0:], w[r0:], pool, nblk, table, nblk, lens[r0:], g, MAX_Q, scores, ctx, hist)
            kern.select(scores, ctx, lens[r0:], n, pos[r0:], counts[r0:], nans[r0:], hist, split_plans)

    run()
    cp.cuda.runtime.deviceSynchronize()
    ms = timed(run, reps)
    flops = 2 * HEADS * DIM * float(lens_h.astype(np.float64).sum())
    return {"kind": "prefill", "tokens": tokens, "context": ctx, "ms": ms, "tokens_per_s": tokens / ms * 1e3,
            "tflops": flops / ms / 1e9, "score_chunk_rows": chunk, "topk_form": "split" if split else "single"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    ap.add_argument("--json")
    a = ap.parse_args()
    rng = np.random.default_rng(7)
    cp.random.seed(7)
    kern = Kernels()
    copy = copy_bandwidth()
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"{dev}: device copy {copy:.0f} GB/s (read + write)")
    rows = [decode_case(kern, rng, 8, 4096, 2, check=True), decode_case(kern, rng, 64, 32768, 1, check=True)]
    if a.quick:
        shapes = [(64, 32768, 1), (64, 32768, 2), (64, 131072, 1), (1, 32768, 1), (32, 8192, 1)]
        pre = [(4096, 8192), (4096, 32768)]
    else:
        shapes = [(b, c, s) for s in (1, 2) for c in (8192, 32768, 131072) for b in (1, 8, 32, 64, 128, 256)]
        pre = [(4096, 8192), (4096, 32768), (8192, 32768), (16384, 65536), (32768, 131072)]
    for b, c, s in shapes:
        r = decode_case(kern, rng, b, c, s, naive=b * c * (DIM + 4) < (64 << 20))
        r["copy_fraction"] = r["gb_per_s"] / copy
        rows.append(r)
    for t, c in pre:
        rows.append(prefill_case(kern, rng, t, c))
    print(f"{'kind':<8} {'b/T':>6} {'ctx':>7} {'s_q':>3} {'ms':>8} {'GB/s':>7} {'copy%':>6} {'TFLOPS':>7}  baseline / check")
    for r in rows:
        if r["kind"] == "decode":
            base = f"naive torch {r['torch_naive_ms']:.3f} ms" if r.get("torch_naive_ms") else ""
            if "score_diff" in r:
                base += f" check ok={r['ok']} diff={r['score_diff']:.1e}"
            cf = f"{100 * r['copy_fraction']:.0f}%" if "copy_fraction" in r else "-"
            print(f"decode   {r['batch']:>6} {r['context']:>7} {r['s_q']:>3} {r['ms']:>8.3f} {r['gb_per_s']:>7.0f} {cf:>6} "
                  f"{r['tflops']:>7.1f}  scores {r['scores_ms']:.3f} + top-k {r['topk_ms']:.3f} ({r['topk_form']}"
                  + (f"; split {r['topk_split_ms']:.3f}, single {r['topk_single_ms']:.3f}, same={r['forms_equal']}, steps "
                     + "/".join(f"{x:.3f}" for x in r["topk_split_steps_ms"]) if "topk_single_ms" in r else "")
                  + f") ms; {base}")
        else:
            print(f"prefill  {r['tokens']:>6} {r['context']:>7}   - {r['ms']:>8.3f}       -      - {r['tflops']:>7.1f}  "
                  f"{r['tokens_per_s']:.0f} tokens/s (top-k {r['topk_form']}, chunks of {r['score_chunk_rows']})")
    if a.json:
        json.dump({"device": dev, "copy_gb_per_s": copy, "flush": "write" if WRITE_FLUSH else "read", "rows": rows},
                  open(a.json, "w"), indent=1)
    sys.exit(0 if all(r.get("ok", True) for r in rows) else 1)


if __name__ == "__main__":
    main()
