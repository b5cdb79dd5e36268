"""The fast kernel loop: loads engine/kernels/*.cu on the GPU machine through CuPy's NVRTC (no Rust build,
no re-carry) and checks and times one kernel family against a NumPy reference.

  python3 scripts/kernel-loop.py FAMILY|all [--tokens N] [--json FILE]

Edit a .cu file here, send it with a device call, run this there. The Rust tests (engine::cuda, run by
scripts/gpu-test.sh) stay the reference: this loop is for iterating quickly on one kernel. Where nvcc builds
the module, or NVRTC (TANDEM_LOOP_COMPILER=nvrtc: the engine's compiler), TANDEM_LOOP_DEFINES adds its words
to the command line (e.g. "-DNAME=1"), so one device call can time variants of a kernel that a macro selects
(bench/gpu/*_bench.py load kernels through here too).
"""
import argparse
import ctypes
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

try:
    import cupy as cp
except ImportError:  # pragma: no cover - the GPU machine has CuPy
    sys.exit("kernel-loop.py needs CuPy (installed on the GPU machine)")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "engine", "kernels")
BLOCK = 64
E4M3_MAX = 448.0


def module(family):
    """The family compiled for sm_90a (wgmma needs the `a` target): by nvcc where the machine has it, else
    (or with TANDEM_LOOP_COMPILER=nvrtc, the compiler the engine uses) by NVRTC through CuPy."""
    src = os.path.join(ROOT, family + ".cu")
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if os.environ.get("TANDEM_LOOP_COMPILER", "") == "nvrtc":
        nvcc = None
    if nvcc:
        out = os.path.join(tempfile.gettempdir(), f"tandem-loop-{family}.cubin")
        subprocess.run([nvcc, "-cubin", "-arch=sm_90a", "-std=c++17", "-lineinfo", "-I", os.path.abspath(ROOT), src,
                        "-o", out] + os.environ.get("TANDEM_LOOP_DEFINES", "").split(), check=True)
        return cp.RawModule(path=out)
    # CuPy's cache keys on the source and the options, not on the headers found through -I: their hash goes
    # into the options, so a header edited on its own is compiled again.
    heads = hashlib.sha256(b"".join(open(os.path.join(ROOT, h), "rb").read() for h in sorted(os.listdir(ROOT))
                                    if h.endswith(".cuh"))).hexdigest()[:16]
    opts = ("-std=c++17", "-I" + os.path.abspath(ROOT), "-lineinfo", "--gpu-architecture=sm_90a",
            "-DTANDEM_NVRTC=1", f"-DTANDEM_HEADERS_{heads}=1")
    opts += tuple(os.environ.get("TANDEM_LOOP_DEFINES", "").split())
    return cp.RawModule(code=open(src).read(), options=opts, backend="nvrtc")


TOPK_SMEM = (8 * 2048 + 8192) * 4  # engine::cuda::topk::SHARED_BYTES


def set_smem(fn, nbytes):
    """Allows `nbytes` of dynamic shared memory (above the 48 KiB default)."""
    try:
        fn.max_dynamic_shared_size_bytes = nbytes
    except AttributeError:
        cp.cuda.driver.funcSetAttribute(fn.ptr, 8, nbytes)  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


def _loop_define(name, default):
    """The value of `-DNAME=V` in TANDEM_LOOP_DEFINES (the flags the kernels are built with), else `default`."""
    for word in os.environ.get("TANDEM_LOOP_DEFINES", "").split():
        if word.startswith(f"-D{name}="):
            return int(word.split("=", 1)[1])
    return default


def indexer_smem(max_q):
    """engine::cuda::indexer::shared_bytes: alignment slack, key stages of 9216 bytes (engine::cuda::indexer::stages,
    or a -DIDX_STAGES / -DIDX_STAGES_GROUP4 variant's), q tiles, the stages' mbarriers, the CTA's table entries
    and the queries' lengths, head weights and first-digit counts."""
    nst = _loop_define("IDX_STAGES_GROUP4", 2) if max_q >= 4 else _loop_define("IDX_STAGES", 3)
    return 1024 + nst * 9216 + max_q * 8192 + nst * 8 + 16 * 4 + 4 * 4 + max_q * (64 * 4 + 1025 * 4)


class TensorMap(ctypes.Structure):
    """A CUtensorMap (128 opaque bytes), passed to a kernel by value."""
    _fields_ = [("opaque", ctypes.c_uint64 * 16)]


_MAPS = {}


def indexer_keys_map(pool, num_blocks):
    """The TMA map the scorer reads an indexer region through: `num_blocks` blocks of 8448 bytes as rows of 128
    bytes, boxes of one block (66 rows), 128-byte swizzle (engine::cuda::gemm::TensorMap::index_blocks)."""
    key = (pool.data.ptr, num_blocks)
    if key not in _MAPS:
        dims = (ctypes.c_uint64 * 2)(128, num_blocks * 66)
        strides = (ctypes.c_uint64 * 1)(128)
        box = (ctypes.c_uint32 * 2)(128, 66)
        elem = (ctypes.c_uint32 * 2)(1, 1)
        # The encoder writes at a 64-byte aligned address (the driver's requirement); a kernel parameter is
        # copied from wherever it lies. UINT8, rank 2, interleave none, swizzle 128B, L2 promotion 256B, no OOB fill.
        buf = ctypes.create_string_buffer(128 + 64)
        at = (ctypes.addressof(buf) + 63) & ~63
        r = _libcuda().cuTensorMapEncodeTiled(ctypes.c_void_p(at), 0, 2, ctypes.c_void_p(pool.data.ptr), dims,
                                              strides, box, elem, 0, 3, 3, 0)
        if r != 0:
            raise RuntimeError(f"cuTensorMapEncodeTiled: {r}")
        m = TensorMap()
        ctypes.memmove(ctypes.byref(m), at, 128)
        _MAPS[key] = m
    return _MAPS[key]


_LIBCUDA = []


def _libcuda():
    if not _LIBCUDA:
        _LIBCUDA.append(ctypes.CDLL("libcuda.so.1"))
    return _LIBCUDA[0]


def launch(fn, grid, block, smem, args):
    """Launches `fn` (a CuPy RawKernel) on CuPy's current stream through the driver, which takes the tensor-map
    parameters CuPy's own launch cannot: `args` are CuPy arrays, NumPy scalars, None (a null pointer) or tensor
    maps."""
    vals = []
    for a in args:
        if isinstance(a, cp.ndarray):
            vals.append(ctypes.c_uint64(a.data.ptr))
        elif a is None:
            vals.append(ctypes.c_uint64(0))
        elif isinstance(a, np.int64):
            vals.append(ctypes.c_int64(int(a)))
        elif isinstance(a, np.int32):
            vals.append(ctypes.c_int32(int(a)))
        elif isinstance(a, TensorMap):
            vals.append(a)
        else:
            raise TypeError(f"launch: argument {a!r}")
    params = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in vals])
    grid = tuple(grid) + (1,) * (3 - len(grid))
    block = tuple(block) + (1,) * (3 - len(block))
    f = fn.kernel.ptr if hasattr(fn, "kernel") else fn.ptr  # a RawKernel's CUfunction
    r = _libcuda().cuLaunchKernel(ctypes.c_void_p(f), *grid, *block, smem,
                                  ctypes.c_void_p(cp.cuda.get_current_stream().ptr), params, None)
    if r != 0:
        raise RuntimeError(f"cuLaunchKernel: error {r}")


def indexer_scores(fn, grid, pool, num_blocks, args, smem):
    """Launches tandem_indexer_scores on CuPy's current stream: its tensor map of `pool`, then `args` (the
    kernel's other parameters, in order)."""
    launch(fn, grid, (128,), smem, [indexer_keys_map(pool, num_blocks)] + list(args))


def e4m3_codes(x):
    """f32 -> e4m3fn bytes, round to nearest even, saturating at +-448 (engine::fp8::f32_to_e4m3)."""
    x = np.asarray(x, dtype=np.float32)
    sign = np.where(np.signbit(x), 0x80, 0).astype(np.uint32)
    a = np.minimum(np.abs(x), E4M3_MAX).astype(np.float32)
    sub = np.rint(a * 512.0).astype(np.uint32)  # np.rint rounds half to even
    bits = a.view(np.uint32)
    rounded = bits + 0x7FFFF + ((bits >> 20) & 1)
    exp = (rounded >> 23).astype(np.int64) - 127
    normal = (((exp + 7) << 3).astype(np.uint32) | ((rounded >> 20) & 7)).astype(np.uint32)
    code = np.where(a < 1.0 / 64.0, sub, normal)
    return (sign | code).astype(np.uint8)


def ue8m0_scales(groups):
    """engine::fp8::group_scale with ue8m0, one per row of `groups`."""
    amax = np.max(np.abs(groups), axis=-1).astype(np.float32)
    s = (np.maximum(amax, np.float32(1e-4)) * np.float32(1.0 / E4M3_MAX)).astype(np.float32)
    bits = s.view(np.uint32)
    e = ((bits >> 23) & 0xFF).astype(np.int64) - 127 + ((bits & 0x7FFFFF) != 0)
    return np.ldexp(np.float32(1.0), e).astype(np.float32)


def bf16_bits(x):
    b = np.asarray(x, dtype=np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def random_values(rng, shape):
    mag = np.exp2(rng.integers(-12, 12, size=shape)).astype(np.float32)
    v = (rng.random(shape, dtype=np.float32) * 2 - 1) * mag
    v[rng.random(shape) < 0.03] = 0.0
    v[rng.random(shape) < 0.03] = -0.0
    return v.astype(np.float32)


def time_ms(fn, reps=20, flush=None, graph=True):
    """Median ms of `reps` runs of `fn` (after `flush()` each time, untimed). With `graph`, `fn`'s launches are
    captured once into a CUDA graph and replayed, so the time is the GPU's and not Python's launch overhead
    (what the engine sees once its decode step is graphed). `graph=False` times eager launches on the
    default stream (PyTorch baselines, which launch on it)."""
    stream = cp.cuda.Stream(non_blocking=True) if graph else cp.cuda.Stream.null
    with stream:
        fn()  # allocations and first-use setup happen outside the capture
        stream.synchronize()
        run = fn
        if graph:
            stream.begin_capture()
            fn()
            g = stream.end_capture()
            run = lambda: g.launch(stream)  # noqa: E731
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        times = []
        for _ in range(reps):
            if flush:
                flush()
            start.record(stream)
            run()
            stop.record(stream)
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def cache_quant(tokens, rng):
    rank, rope, dim = 512, 64, 128
    entry, iblock = rank + 4 * (rank // 128) + 2 * rope, BLOCK * (dim + 4)
    num_blocks = -(-tokens // BLOCK) + 3
    c = random_values(rng, (tokens, rank))
    k_pe = random_values(rng, (tokens, rope))
    keys = random_values(rng, (tokens, dim))
    slots = rng.permutation(num_blocks * BLOCK)[:tokens].astype(np.int64)
    slots[rng.random(tokens) < 0.05] = -1

    # NumPy reference of engine::cache::format's encoders, into poisoned regions.
    want_lat = np.full(num_blocks * BLOCK * entry, 0xA5, dtype=np.uint8)
    want_idx = np.full(num_blocks * iblock, 0xA5, dtype=np.uint8)
    tiles = c.reshape(tokens, rank // 128, 128)
    s_lat = ue8m0_scales(tiles)
    q_lat = e4m3_codes(tiles / s_lat[..., None]).reshape(tokens, rank)
    s_idx = ue8m0_scales(keys)
    q_idx = e4m3_codes(keys / s_idx[:, None])
    rope_b = bf16_bits(k_pe)
    for t in np.nonzero(slots >= 0)[0]:
        s = int(slots[t])
        e = want_lat[s * entry:(s + 1) * entry]
        e[:rank] = q_lat[t]
        e[rank:rank + 16] = s_lat[t].view(np.uint8)
        e[rank + 16:] = rope_b[t].view(np.uint8)
        b, off = divmod(s, BLOCK)
        blk = want_idx[b * iblock:(b + 1) * iblock]
        blk[off * dim:(off + 1) * dim] = q_idx[t]
        blk[BLOCK * dim + 4 * off:BLOCK * dim + 4 * off + 4] = s_idx[t:t + 1].view(np.uint8)

    m = module("cache_quant")
    k_lat, k_idx = m.get_function("tandem_quantize_latent_fp8"), m.get_function("tandem_quantize_index_keys_fp8")
    dc, dk, dkeys, dslots = (cp.asarray(a) for a in (c, k_pe, keys, slots))
    lat = cp.full(want_lat.shape, 0xA5, dtype=cp.uint8)
    idx = cp.full(want_idx.shape, 0xA5, dtype=cp.uint8)
    cap = np.int64(num_blocks * BLOCK)

    def run():
        k_lat((tokens,), (32 * rank // 128,), (dc, dk, dslots, lat, np.int32(tokens), np.int32(rank), np.int32(rope), cap))
        k_idx((-(-tokens // 4),), (128,), (dkeys, dslots, idx, np.int32(tokens), cap))

    run()
    cp.cuda.runtime.deviceSynchronize()
    ok = bool((cp.asnumpy(lat) == want_lat).all() and (cp.asnumpy(idx) == want_idx).all())
    ms = time_ms(run)
    moved = tokens * ((rank + rope + dim) * 4 + 8 + entry + dim + 4)
    return {"family": "cache_quant", "tokens": tokens, "bit_identical": ok, "ms": ms, "gb_per_s": moved / ms / 1e6}


def topk_reference(row, k):
    """engine::cpu::topk::select: score desc (-0.0 == +0.0), later position first, NaN out, ascending."""
    n = len(row)
    if n <= k:
        return np.arange(n)
    pos = np.nonzero(~np.isnan(row))[0]
    order = np.lexsort((-pos, -row[pos]))[:k]
    return np.sort(pos[order])


def topk(tokens, rng):
    k, rows = 2048, 64
    out = []
    m = module("topk")
    fn = m.get_function("tandem_topk_rule")
    set_smem(fn, TOPK_SMEM)
    for n in (max(tokens // 2, k + 1), tokens * 2):
        scores = rng.random((rows, n), dtype=np.float32) * 4 - 1
        scores[rng.random((rows, n)) < 0.25] = 0.0
        scores[rng.random((rows, n)) < 0.01] = -0.0
        scores[rng.random((rows, n)) < 0.001] = np.nan
        # Full rows, so torch.topk over the same [rows, n] matrix does the same work.
        lengths = np.full(rows, n, dtype=np.int32)
        d_scores, d_len = cp.asarray(scores), cp.asarray(lengths)
        pos = cp.full((rows, k), -5, dtype=cp.int32)
        counts, nans = cp.zeros(rows, dtype=cp.int32), cp.zeros(rows, dtype=cp.int32)

        def run():
            fn((rows,), (1024,), (d_scores, np.int64(n), d_len, np.int32(k), pos, counts, nans, np.uint64(0)),
               shared_mem=TOPK_SMEM)

        run()
        cp.cuda.runtime.deviceSynchronize()
        got, cnt = cp.asnumpy(pos), cp.asnumpy(counts)
        ok = True
        for r in range(rows):
            want = topk_reference(scores[r, :lengths[r]], k)
            ok &= cnt[r] == len(want) and (got[r, :cnt[r]] == want).all() and (got[r, cnt[r]:] == -1).all()
        ms = time_ms(run)
        row = {"family": "topk", "tokens": int(n), "rows": rows, "k": k, "bit_identical": bool(ok), "ms": ms,
               "gb_per_s": float(lengths.sum()) * 4 / ms / 1e6}
        try:
            import torch
            t = torch.as_tensor(scores, device="cuda")
            row["torch_topk_ms"] = time_ms(lambda: torch.topk(t, k, dim=1), graph=False)
        except Exception as e:  # noqa: BLE001 - the baseline is optional
            row["torch_topk_ms"] = None
            print("torch baseline unavailable:", e)
        out.append(row)
    return out


def e4m3_values():
    """Every e4m3fn code's value (NaN codes as 0; the generator never draws them)."""
    v = np.zeros(256, dtype=np.float32)
    for b in range(256):
        e, m = (b >> 3) & 15, b & 7
        if e == 15 and m == 7:
            continue
        mag = m / 512.0 if e == 0 else (1 + m / 8.0) * 2.0 ** (e - 7)
        v[b] = -mag if b & 0x80 else mag
    return v


def indexer(tokens, rng):
    """Decode scores over paged FP8 keys + the top-k rule, next to a naive PyTorch version (gather,
    dequantize, matmul, relu, weighted head sum, torch.topk) on the same data."""
    heads, dim, k, rows = 64, 128, 2048, 64
    lut = e4m3_values()
    out = []
    m_idx, m_topk = module("indexer"), module("topk")
    f_scores, f_topk = m_idx.get_function("tandem_indexer_scores"), m_topk.get_function("tandem_topk_rule")
    set_smem(f_scores, max(indexer_smem(m) for m in range(1, 5)))
    set_smem(f_topk, TOPK_SMEM)
    for ctx in (tokens // 2, tokens * 2):
        nblk = ctx // BLOCK
        num_blocks = rows * nblk
        pool = cp.random.randint(0, 256, size=(num_blocks, BLOCK * (dim + 4)), dtype=cp.int32).astype(cp.uint8)
        pool[pool == 0x7F] = 0
        pool[pool == 0xFF] = 0
        scales = cp.exp2(cp.random.randint(-8, 4, size=(num_blocks, BLOCK))).astype(cp.float32)
        pool[:, BLOCK * dim:] = scales.view(cp.uint8).reshape(num_blocks, BLOCK * 4)
        table = cp.asarray(rng.permutation(num_blocks).reshape(rows, nblk).astype(np.int32))
        q = cp.random.randint(0, 256, size=(rows, heads, dim), dtype=cp.int32).astype(cp.uint8)
        q[q == 0x7F] = 0
        q[q == 0xFF] = 0
        w = (cp.random.random((rows, heads), dtype=cp.float32) - 0.3).astype(cp.float32)
        lens = cp.full(rows, ctx, dtype=cp.int32)
        scores = cp.zeros((rows, ctx), dtype=cp.float32)
        pos = cp.zeros((rows, k), dtype=cp.int32)
        counts, nans = cp.zeros(rows, dtype=cp.int32), cp.zeros(rows, dtype=cp.int32)

        groups = cp.asarray(np.array([[r, 1] for r in range(rows)], dtype=np.int32).reshape(-1))

        hist = cp.zeros((rows, 2049), dtype=cp.uint32)  # the top-k's first digit, counted by the scorer

        def run():
            hist.fill(0)
            indexer_scores(f_scores, (-(-nblk // 8), rows), pool, num_blocks,
                           (q, w, np.int32(heads), table, np.int32(nblk), np.int32(num_blocks), lens, groups, np.int32(1),
                            scores, np.int64(ctx), hist), indexer_smem(1))
            f_topk((rows,), (1024,), (scores, np.int64(ctx), lens, np.int32(k), pos, counts, nans, hist), shared_mem=TOPK_SMEM)

        run()
        cp.cuda.runtime.deviceSynchronize()
        # Reference on two rows (f64 on the host).
        lut_d = lut.astype(np.float64)
        ok, worst = True, 0.0
        host_pool, host_table = cp.asnumpy(pool), cp.asnumpy(table)
        for r in (0, rows - 1):
            blocks = host_pool[host_table[r]]
            keys = lut_d[blocks[:, :BLOCK * dim].reshape(-1, dim)]
            ks = blocks[:, BLOCK * dim:].copy().view(np.float32).reshape(-1).astype(np.float64)
            qd = lut_d[cp.asnumpy(q[r])]
            ref = (np.maximum(keys @ qd.T, 0) @ cp.asnumpy(w[r]).astype(np.float64)) * ks
            got = cp.asnumpy(scores[r]).astype(np.float64)
            diff = 1 - 2 * (got * ref).sum() / (got * got + ref * ref).sum()
            worst = max(worst, diff)
            ok &= diff < 1e-6
            sel = cp.asnumpy(pos[r])
            ok &= (sel == topk_reference(cp.asnumpy(scores[r]), k)).all()
        ms = time_ms(run)
        moved = rows * ctx * (dim + 4) + q.nbytes + w.nbytes
        row = {"family": "indexer", "tokens": ctx, "rows": rows, "k": k, "within_tolerance": bool(ok), "score_diff": worst,
               "ms": ms, "gb_per_s": moved / ms / 1e6}
        try:
            import torch
            tp, tt = torch.as_tensor(pool, device="cuda"), torch.as_tensor(table, device="cuda").long()
            tq, tw, tl = torch.as_tensor(q, device="cuda"), torch.as_tensor(w, device="cuda"), torch.as_tensor(lut, device="cuda")

            def naive():
                blk = tp[tt]  # [rows, nblk, 8448]
                kv = tl[blk[..., :BLOCK * dim].long()].reshape(rows, ctx, dim)
                ks_ = blk[..., BLOCK * dim:].contiguous().view(torch.float32).reshape(rows, ctx)
                logits = torch.relu(torch.bmm(kv, tl[tq.long()].transpose(1, 2)))
                s_ = (logits * tw[:, None, :]).sum(-1) * ks_
                return torch.topk(s_, k, dim=1)

            row["torch_naive_ms"] = time_ms(naive, reps=5, graph=False)
        except Exception as e:  # noqa: BLE001 - the baseline is optional
            row["torch_naive_ms"] = None
            print("torch baseline unavailable:", e)
        out.append(row)
    return out


FAMILIES = {"cache_quant": cache_quant, "topk": topk, "indexer": indexer}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("family", choices=sorted(FAMILIES) + ["all"])
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--json")
    a = ap.parse_args()
    rng = np.random.default_rng()
    names = sorted(FAMILIES) if a.family == "all" else [a.family]
    rows = []
    for n in names:
        r = FAMILIES[n](a.tokens, rng)
        rows.extend(r if isinstance(r, list) else [r])
    print(f"{'family':<14} {'tokens':>8} {'ok':>6} {'ms':>8} {'GB/s':>8}  baseline")
    for r in rows:
        base = f"torch.topk {r['torch_topk_ms']:.3f} ms" if r.get("torch_topk_ms") else ""
        base = f"naive torch {r['torch_naive_ms']:.3f} ms, diff {r['score_diff']:.1e}" if r.get("torch_naive_ms") else base
        print(f"{r['family']:<14} {r['tokens']:>8} {str(r.get('bit_identical', r.get('within_tolerance'))):>6} {r['ms']:>8.3f} {r['gb_per_s']:>8.1f}  {base}")
    if a.json:
        json.dump({"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "rows": rows}, open(a.json, "w"), indent=1)
    sys.exit(0 if all(r.get("bit_identical", r.get("within_tolerance")) for r in rows) else 1)


if __name__ == "__main__":
    main()
