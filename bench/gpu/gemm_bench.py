"""Benchmark of the FP8 block-scaled GEMM (issue: FP8 GEMMs and MoE): engine/kernels/gemm.cu next to
cuBLASLt through torch._scaled_mm in the same run (DeepSeek block scaling: 1x128 activation scales, 128x128
weight scales; and per-tensor scaling, the stretch) and the same-run copy bandwidth.

  python3 bench/gpu/gemm_bench.py [--quick] [--json FILE]

Every shape of DeepSeek-V3.2's FP8 linears (N x K), M = 1..8192 tokens. Each timing is a CUDA graph replay of
one launch after a 256 MiB read that evicts the L2 (bench/gpu/torch_timing.py), median of the runs; bf16 output
for every kernel.
TFLOPS = 2 M N K / time; weight GB/s = (N K + scale bytes) / time, the figure of merit where M <= 256 (the
weights are read once; target >= 80% of the same-run copy bandwidth); at M >= 1024 the target is >= 1.0x
cuBLASLt block-scaled.

Before timing, the script checks the kernel against an f64 reference of the dequantized operands (and
cuBLASLt's output), and batch invariance: a row's output bits do not depend on M or on the tile width.
The kernels are loaded through the CUDA driver (ctypes): their tensor-map parameters are 128-byte structs.
"""
import argparse
import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile


try:
    import torch
except ImportError:  # pragma: no cover - the GPU machine has PyTorch
    sys.exit("gemm_bench.py needs PyTorch (installed on the GPU machine)")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_timing import copy_gbps, timed  # noqa: E402
KERNELS = os.path.join(ROOT, "engine", "kernels")
DEV = "cuda"
BM, BK = 128, 128
BM_SMALL = 64  # small products' tile height (engine::cuda::gemm::BM_SMALL)
MAX_K_BLOCKS = 256  # engine::cuda::gemm::MAX_K_BLOCKS
SCALE_BOX = BM + 4  # row scales per TMA box (engine::cuda::gemm::SCALE_BOX)


def _stage_define(name, default):
    """A GEMM_STAGES_* value as the kernel is built with it: `-DNAME=N` in TANDEM_LOOP_DEFINES, else the
    kernel's default (so the shared memory launched always matches the kernel's layout)."""
    m = re.search(rf"-D{name}=(\d+)", os.environ.get("TANDEM_LOOP_DEFINES", ""))
    return int(m.group(1)) if m else default


# engine::cuda::gemm::stages: 128-row tiles keep their output tile in shared memory for the TMA store, so fewer
# stages fit beside it.
STAGES = {(128, 128, "f32"): _stage_define("GEMM_STAGES_128_F32", 4),
          (128, 128, "bf16"): _stage_define("GEMM_STAGES_128_BF16", 5),
          (128, 64, "f32"): _stage_define("GEMM_STAGES_64_F32", 7),
          (128, 64, "bf16"): _stage_define("GEMM_STAGES_64_BF16", 8)}
for _o in ("f32", "bf16"):
    STAGES[(BM_SMALL, 128, _o)] = _stage_define("GEMM_STAGES_M64_128", 9)
    STAGES[(BM_SMALL, 64, _o)] = _stage_define("GEMM_STAGES_M64_64", 13)
# engine::cuda::gemm::tma_store: 128-row tiles of plain products store through shared memory and TMA
# (TANDEM_GEMM_TMA_STORE=0: register stores, the same bits, for A/B measurements).
TMA_STORE = os.environ.get("TANDEM_GEMM_TMA_STORE", "1") != "0"


def threads(bm):
    return 128 * (1 + bm // 64)

# (name, N, K): the model's FP8 linears (DeepSeek-V3.2: hidden 7168, q_lora 1536, kv_lora 512 + rope 64,
# 128 heads, MLP 18432, experts 2048, indexer 64 x 128; kv_b is the prefill's decompression of the latent).
SHAPES = [
    ("q_a", 1536, 7168),
    ("q_b", 24576, 1536),
    ("kv_a", 576, 7168),
    ("o_proj", 7168, 16384),
    ("kv_b", 32768, 512),
    ("idx_wq_b", 8192, 1536),
    ("idx_wk", 128, 7168),
    ("mlp_gate_up", 36864, 7168),
    ("mlp_down", 7168, 18432),
    ("expert_gate_up", 4096, 7168),
    ("expert_down", 7168, 2048),
]
BASELINE_SHAPES = {(24576, 1536), (7168, 16384), (4096, 7168), (7168, 2048), (36864, 7168)}
MS = [1, 16, 64, 128, 256, 1024, 2048, 4096, 8192]


# ---------------------------------------------------------------------------------------------------------
# The CUDA driver through ctypes.

from cuda_driver import check, cuda as _cuda, report  # noqa: E402,F401 (check: moe_bench imports it here)


class TensorMap(ctypes.Structure):
    _fields_ = [("opaque", ctypes.c_uint64 * 16)]


def _encoded(encode, what):
    """A TensorMap filled by `encode(address)` at a 64-byte aligned address (the driver's requirement for the
    encoder; a kernel parameter is copied from wherever it lies)."""
    buf = ctypes.create_string_buffer(128 + 64)
    addr = (ctypes.addressof(buf) + 63) & ~63
    check(encode(ctypes.c_void_p(addr)), what)
    m = TensorMap()
    ctypes.memmove(ctypes.byref(m), addr, 128)
    return m


def tensor_map(t, rows, cols, box_rows):
    """A 2-D TMA map of the u8 matrix `t` [rows, cols] with a [box_rows x 128] box, 128-byte swizzle, zero fill."""
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(cols)
    box = (ctypes.c_uint32 * 2)(BK, box_rows)
    elem = (ctypes.c_uint32 * 2)(1, 1)
    # UINT8, rank 2, interleave none, swizzle 128B (3), L2 promotion 256B (3), OOB fill none (zeros)
    return _encoded(lambda at: _cuda.cuTensorMapEncodeTiled(at, 0, 2, ctypes.c_void_p(t.data_ptr()), dims, strides, box,
                                                            elem, 0, 3, 3, 0), "cuTensorMapEncodeTiled")


def out_map(y):
    """A 2-D TMA map of the output y [rows, n] (f32 or bf16) for the TMA store: boxes of 64 rows x one
    128-byte row (32 f32 / 64 bf16 columns), 128-byte swizzle; None where TMA cannot address it (a row stride
    or address not a multiple of 16 bytes: engine::cuda::gemm::TensorMap::output)."""
    rows, n = y.shape
    esz = y.element_size()
    if (n * esz) % 16 or y.data_ptr() % 16:
        return None
    dims = (ctypes.c_uint64 * 2)(n, rows)
    strides = (ctypes.c_uint64 * 1)(n * esz)
    box = (ctypes.c_uint32 * 2)(128 // esz, 64)
    elem = (ctypes.c_uint32 * 2)(1, 1)
    # FLOAT32 (7) or BFLOAT16 (9), swizzle 128B (3), no L2 promotion
    dtype = 9 if y.dtype == torch.bfloat16 else 7
    return _encoded(lambda at: _cuda.cuTensorMapEncodeTiled(at, dtype, 2, ctypes.c_void_p(y.data_ptr()), dims, strides,
                                                            box, elem, 0, 3, 0, 0), "cuTensorMapEncodeTiled (out)")


def scale_map(sa_t, rows):
    """A 2-D TMA map of the transposed activation scales sa_t [groups, ld] (f32, ld >= rows, a multiple of 4)
    with a [1 x SCALE_BOX] box: one K block's scales of a row tile (from its first row rounded down to a multiple
    of 4: engine::cuda::gemm::SCALE_BOX), zero past `rows`."""
    dims = (ctypes.c_uint64 * 2)(rows, sa_t.shape[0])
    strides = (ctypes.c_uint64 * 1)(sa_t.shape[1] * 4)
    box = (ctypes.c_uint32 * 2)(SCALE_BOX, 1)
    elem = (ctypes.c_uint32 * 2)(1, 1)
    # FLOAT32 (7), no swizzle, no L2 promotion
    return _encoded(lambda at: _cuda.cuTensorMapEncodeTiled(at, 7, 2, ctypes.c_void_p(sa_t.data_ptr()), dims, strides,
                                                            box, elem, 0, 0, 0, 0), "cuTensorMapEncodeTiled (scales)")


def transposed_scales(sa):
    """[M, groups] -> [groups, ld] with ld = M rounded up to 4 (the layout tandem_act_quant writes for the GEMM)."""
    m, g = sa.shape
    t = torch.zeros(g, -(-m // 4) * 4, device=sa.device, dtype=torch.float32)
    t[:, :m] = sa.t()
    return t


class Gemm:
    def __init__(self):
        nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
        out = os.path.join(tempfile.gettempdir(), "tandem-gemm.cubin")
        subprocess.run([nvcc, "-cubin", "-arch=sm_90a", "-std=c++17", "-lineinfo", "-I", os.path.abspath(KERNELS),
                        os.path.join(KERNELS, "gemm.cu"), "-o", out] + os.environ.get("TANDEM_LOOP_DEFINES", "").split(),
                       check=True)
        torch.zeros(1, device=DEV)  # the primary context, current on this thread
        self.mod = ctypes.c_void_p()
        check(_cuda.cuModuleLoad(ctypes.byref(self.mod), out.encode()), "cuModuleLoad")
        self.fns = {}
        for bm in (BM, BM_SMALL):
            for bn in (128, 64):
                for out_t in ("f32", "bf16"):
                    for chained in (False, True):
                        f = ctypes.c_void_p()
                        name = kernel_name(bm, bn, out_t, chained)
                        check(_cuda.cuModuleGetFunction(ctypes.byref(f), self.mod, name.encode()), name)
                        check(_cuda.cuFuncSetAttribute(f, 8, smem_bytes(bm, bn, out_t)), "max dynamic shared memory")
                        self.fns[(bm, bn, out_t, chained)] = f
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count

        for out_t in ("f32", "bf16"):
            f = ctypes.c_void_p()
            name = f"tandem_gemm_fp8_combine_{out_t}"
            check(_cuda.cuModuleGetFunction(ctypes.byref(f), self.mod, name.encode()), name)
            self.fns[("combine", out_t)] = f

    def tile_n(self, m, n):
        """engine::cuda::gemm::tile_n: 128-wide tiles where they fill the SMs, else 64."""
        return 128 if -(-m // BM) * -(-n // 128) >= self.sms else 64

    def plan(self, m, n, kpad):
        """engine::cuda::gemm::Plan::new: (tile height, tile width, chains, split)."""
        pairs = max(1, (-(-n // 64) + 1) // 2)
        chains = min(max(1, min(16, (132 // 2) // pairs)), max(1, kpad // BK))  # gemm::CHAIN_SMS
        split = chains > 1 and -(-m // BM) * pairs < self.sms // 2 and m <= 2 * BM and n * kpad >= 512 * 1024
        bm = BM_SMALL if m <= BM_SMALL else BM
        return bm, (64 if split else self.tile_n(m, n)), chains, split

    def prepare(self, qa, sa, w, ws, y, bn=None, split=None, bm=None, tma=None):
        """A launch closure of y = qa . w^T with the block scales (the plan's tile and split unless given; the
        TMA store where the plan takes it unless `tma` says)."""
        m, kpad = qa.shape
        n = w.shape[0]
        pbm, pbn, chains, psplit = self.plan(m, n, kpad)
        split = psplit if split is None else (split and chains > 1)
        bn = bn or (64 if split else pbn)
        bm = bm or pbm
        sa_t = transposed_scales(sa)
        ta, tb, tsa = tensor_map(qa, m, kpad, bm // 2), tensor_map(w, n, kpad, bn), scale_map(sa_t, m)
        out_t = "bf16" if y.dtype == torch.bfloat16 else "f32"
        fn = self.fns[(bm, bn, out_t, chains > 1 and not split)]
        part = torch.empty(chains * m * n if split else 1, device=DEV, dtype=torch.float32)
        ty = out_map(y) if (TMA_STORE if tma is None else tma) and bm == BM and not split else None
        vals = [ta, tb, tsa, ty or ta, ctypes.c_uint64(ws.data_ptr()), ctypes.c_int32(ws.shape[1]),
                ctypes.c_uint64(y.data_ptr()), ctypes.c_uint64(part.data_ptr() if split else 0),
                ctypes.c_int32(chains), ctypes.c_int32(m), ctypes.c_int32(n), ctypes.c_int32(kpad),
                ctypes.c_uint64(0), ctypes.c_int32(0), ctypes.c_uint64(0),  # no row tiles: not a grouped product
                ctypes.c_int32(1 if ty is not None else 0)]
        params = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in vals])
        units = -(-m // bm) * ((-(-n // bn) + 1) // 2) * (chains if split else 1)
        grid = 2 * min(units, self.sms // 2)  # persistent clusters of two, one CTA per SM at most
        count = m * n
        cvals = [ctypes.c_uint64(part.data_ptr()), ctypes.c_int32(chains), ctypes.c_int64(count),
                 ctypes.c_uint64(y.data_ptr())]
        cparams = (ctypes.c_void_p * len(cvals))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in cvals])
        cfn = self.fns[("combine", out_t)]
        cgrid = min(-(-count // 256), 4 * self.sms)
        keep = (vals, params, cvals, cparams, qa, sa_t, w, ws, y, part)

        def launch():
            _ = keep
            stream = torch.cuda.current_stream().cuda_stream
            check(_cuda.cuLaunchKernel(fn, grid, 1, 1, threads(bm), 1, 1, smem_bytes(bm, bn, out_t), ctypes.c_void_p(stream),
                                       params, None), "cuLaunchKernel")
            if split:
                check(_cuda.cuLaunchKernel(cfn, cgrid, 1, 1, 256, 1, 1, 0, ctypes.c_void_p(stream), cparams, None),
                      "cuLaunchKernel (combine)")

        launch.plan = (bm, bn, chains, split)
        launch.tma_store = ty is not None
        return launch


def kernel_name(bm, bn, out_t, chained):
    """engine::cuda::gemm::kernel_name: 128-row tiles have a kernel without in-tile chains (one chain, or split
    launches) and one with them; 64-row tiles one kernel for both."""
    if bm == BM:
        return f"tandem_gemm_fp8_n{bn}_{out_t}" + ("_chains" if chained else "")
    return f"tandem_gemm_fp8_m{bm}_n{bn}_{out_t}"


def smem_bytes(bm, bn, out_t):
    """engine::cuda::gemm::smem_bytes."""
    slot = (SCALE_BOX * 4 + 127) // 128 * 128
    out = bm * bn * (2 if out_t == "bf16" else 4) if bm == BM else 0
    return 1024 + STAGES[(bm, bn, out_t)] * (bm * BK + bn * BK + slot + 16) + out + 16 + bm // 64 * MAX_K_BLOCKS * 4


# ---------------------------------------------------------------------------------------------------------
# Operands.

def ue8m0(amax):
    s = torch.clamp(amax, min=1e-4) / 448.0
    return torch.exp2(torch.ceil(torch.log2(s)))


def quant_act(x):
    """[M, K] f32 -> e4m3 codes [M, K] and scales [M, K / 128] (per row per 128 channels, ue8m0)."""
    m, k = x.shape
    g = x.view(m, k // 128, 128)
    s = ue8m0(g.abs().amax(-1))
    q = (g / s[..., None]).to(torch.float8_e4m3fn).view(m, k)
    return q, s.float().contiguous()


def quant_weight(w):
    """[N, K] f32 -> e4m3 codes and 128 x 128 block scales [ceil(N / 128), K / 128]."""
    n, k = w.shape
    nb = -(-n // 128)
    wp = torch.zeros(nb * 128, k, device=w.device)
    wp[:n] = w
    blocks = wp.view(nb, 128, k // 128, 128)
    s = ue8m0(blocks.abs().amax((1, 3)))
    q = (blocks / s[:, None, :, None]).to(torch.float8_e4m3fn).view(nb * 128, k)[:n].contiguous()
    return q, s.float().contiguous()


def operands(m, n, k, gen):
    x = torch.randn(m, k, device=DEV, generator=gen)
    w = torch.randn(n, k, device=DEV, generator=gen) * (1.0 / k ** 0.5)
    qa, sa = quant_act(x)
    qw, sw = quant_weight(w)
    return qa, sa, qw, sw


def dequant(qa, sa, qw, sw):
    m, k = qa.shape
    n = qw.shape[0]
    a = qa.double().view(m, k // 128, 128) * sa.double()[..., None]
    wb = qw.double().view(n, k // 128, 128) * sw.double().repeat_interleave(128, 0)[:n, :, None]
    return a.view(m, k), wb.view(n, k)


def as_u8(t):
    return t.view(torch.uint8)


# ---------------------------------------------------------------------------------------------------------
# Timing.

def cublas_block(qa, sa, qw, sw):
    """cuBLASLt with DeepSeek block scaling (ENV-NOTES: activation scales column-major, weight scales
    transposed); None where torch refuses the shape."""
    sa_cm = sa.t().contiguous().t()
    sb = sw.t()
    try:
        torch._scaled_mm(qa, qw.t(), scale_a=sa_cm, scale_b=sb, out_dtype=torch.bfloat16)
    except Exception:  # noqa: BLE001 - torch names the shapes it refuses
        return None
    return lambda: torch._scaled_mm(qa, qw.t(), scale_a=sa_cm, scale_b=sb, out_dtype=torch.bfloat16)


def cublas_tensor(qa, qw):
    one = torch.ones((), device=DEV)
    try:
        torch._scaled_mm(qa, qw.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except Exception:  # noqa: BLE001
        return None
    return lambda: torch._scaled_mm(qa, qw.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------
# Checks.

def checks(g, failures):
    gen = torch.Generator(device=DEV).manual_seed(7)
    for (m, n, k) in [(256, 1536, 7168), (200, 576, 7168), (1, 24576, 1536), (129, 7168, 2048), (77, 130, 384)]:
        qa, sa, qw, sw = operands(m, n, k, gen)
        ref = (lambda a, w: a @ w.t())(*dequant(qa, sa, qw, sw))
        for out_dtype, tol in ((torch.float32, 1e-3), (torch.bfloat16, 1e-2)):
            for bm, bn in [(t, w) for t in (BM, BM_SMALL) for w in (128, 64)]:
                y = torch.full((m, n), float("nan"), device=DEV, dtype=out_dtype)
                g.prepare(as_u8(qa), sa, as_u8(qw), sw, y, bn, bm=bm)()
                torch.cuda.synchronize()
                err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
                ok = err <= tol and not torch.isnan(y).any().item()
                print(f"check {m}x{n}x{k} bm={bm} bn={bn} {out_dtype}: max rel err {err:.2e} {'ok' if ok else 'FAIL'}",
                      flush=True)
                if not ok:
                    failures.append(f"accuracy {m}x{n}x{k} bm={bm} bn={bn} {out_dtype}: {err:.2e}")
        base = cublas_block(qa, sa, qw, sw)
        if base is not None:
            err = ((base().double() - ref).abs().max() / ref.abs().max()).item()
            print(f"check {m}x{n}x{k} cuBLASLt block-scaled: max rel err {err:.2e}", flush=True)
    # The TMA store (128-row tiles of plain products) and the register stores write the same bits.
    for (m, n, k) in [(300, 1536, 2048), (129, 576, 512)]:
        qa, sa, qw, sw = operands(m, n, k, gen)
        for out_dtype in (torch.float32, torch.bfloat16):
            for bn in (128, 64):
                ys = []
                for tma in (True, False):
                    y = torch.full((m, n), float("nan"), device=DEV, dtype=out_dtype)
                    f = g.prepare(as_u8(qa), sa, as_u8(qw), sw, y, bn, False, BM, tma)
                    f()
                    ys.append((y, f.tma_store))
                torch.cuda.synchronize()
                same = ys[0][1] and not ys[1][1] and torch.equal(ys[0][0].view(torch.int16 if out_dtype ==
                                                                                torch.bfloat16 else torch.int32),
                                                                  ys[1][0].view(torch.int16 if out_dtype ==
                                                                                torch.bfloat16 else torch.int32))
                print(f"invariance: {m}x{n}x{k} bn = {bn} {out_dtype}: TMA store == register stores: {same}", flush=True)
                if not same:
                    failures.append(f"TMA store != register stores at {m}x{n}x{k} bn {bn} {out_dtype}")
    # Batch invariance: rows of M = 1, 7, 129, 1000 inside M = 4096; tile width 64 against 128.
    n, k = 1536, 7168  # q_a: several chains, split at small M
    qa, sa, qw, sw = operands(4096, n, k, gen)
    full = {}
    for bn in (128, 64):
        y = torch.empty(4096, n, device=DEV, dtype=torch.float32)
        g.prepare(as_u8(qa), sa, as_u8(qw), sw, y, bn)()
        full[bn] = y
    same_bn = torch.equal(full[128], full[64])
    print(f"invariance: tile width 64 == 128 at M = 4096: {same_bn}", flush=True)
    if not same_bn:
        failures.append("tile width 64 != 128")
    for m in (1, 7, 64, 129, 1000):
        for bm in (BM, BM_SMALL):
            for bn, split in ((128, False), (64, False), (64, True)):
                y = torch.empty(m, n, device=DEV, dtype=torch.float32)
                g.prepare(as_u8(qa[:m].contiguous()), sa[:m].contiguous(), as_u8(qw), sw, y, bn, split, bm)()
                same = torch.equal(y, full[128][:m])
                if not same:
                    failures.append(f"rows of M = {m} (bm {bm}, bn {bn}, split {split}) differ from the same rows in "
                                    "M = 4096")
                print(f"invariance: M = {m} bm = {bm} bn = {bn} split {split} rows == rows of M = 4096: {same}",
                      flush=True)
    torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer shapes and batch sizes")
    ap.add_argument("--json")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--both-tiles", action="store_true", help="also time each shape with both tile widths")
    ap.add_argument("--only", help="comma-separated shape names (default: all)")
    ap.add_argument("--ms", help="comma-separated M values (default: 1..8192)")
    ap.add_argument("--compare-bm", action="store_true",
                    help="where the plan takes 64-row tiles, also time 128-row tiles (column 'bm128 us')")
    ap.add_argument("--out", choices=("bf16", "f32"), default="bf16",
                    help="output type of the timed products (cuBLASLt's is bf16 either way; the engine's linears are f32)")
    ap.add_argument("--profile", action="store_true",
                    help="no checks or timing: launch each case 5 times straight (for ncu)")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    g = Gemm()
    failures = []
    if args.profile:
        gen = torch.Generator(device=DEV).manual_seed(1)
        for name, n, k in SHAPES:
            if args.only and name not in args.only.split(","):
                continue
            for m in [int(v) for v in (args.ms or "1").split(",")]:
                qa, sa, qw, sw = operands(m, n, k, gen)
                y = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
                for bm in (BM, BM_SMALL) if m <= BM_SMALL else (BM,):
                    f = g.prepare(as_u8(qa), sa, as_u8(qw), sw, y, bm=bm)
                    for _ in range(5):
                        f()
                    torch.cuda.synchronize()
                    print(f"profiled {name} M = {m} plan {f.plan}", flush=True)
        return
    checks(g, failures)
    copy = copy_gbps()
    print(f"same-run copy: {copy:.0f} GB/s; SMs {g.sms}; {torch.cuda.get_device_name(0)}", flush=True)
    shapes = SHAPES if not args.quick else [s for s in SHAPES if (s[1], s[2]) in BASELINE_SHAPES][:3]
    if args.only:
        shapes = [s for s in SHAPES if s[0] in args.only.split(",")]
    ms = MS if not args.quick else [1, 128, 1024, 4096]
    if args.ms:
        ms = [int(v) for v in args.ms.split(",")]
    gen = torch.Generator(device=DEV).manual_seed(1)
    rows = []
    hdr = f"{'shape':>15} {'N x K':>12} {'M':>5} {'plan':>10} {'ours us':>8} {'TFLOPS':>7} {'wGB/s':>6} {'%copy':>5} " \
          f"{'cuBLAS us':>9} {'x cuBLAS':>8} {'tensor us':>9}"
    print(hdr, flush=True)
    for name, n, k in shapes:
        for m in ms:
            qa, sa, qw, sw = operands(m, n, k, gen)
            y = torch.empty(m, n, device=DEV, dtype=torch.bfloat16 if args.out == "bf16" else torch.float32)
            f = g.prepare(as_u8(qa), sa, as_u8(qw), sw, y)
            bm, bn, chains, split = f.plan
            ours = timed(f, args.reps)
            big = timed(g.prepare(as_u8(qa), sa, as_u8(qw), sw, y, bm=BM), args.reps) \
                if args.compare_bm and bm != BM else None
            both = {t: timed(g.prepare(as_u8(qa), sa, as_u8(qw), sw, y, t, False), args.reps) for t in (64, 128)} \
                if args.both_tiles else None
            b = cublas_block(qa, sa, qw, sw)
            tb = timed(b, args.reps) if b is not None else None
            t = cublas_tensor(qa, qw)
            tt = timed(t, args.reps) if t is not None else None
            flops = 2.0 * m * n * k
            wbytes = n * k + sw.numel() * 4
            r = {"shape": name, "n": n, "k": k, "m": m, "tile_m": bm, "tile_n": bn, "chains": chains, "split": split,
                 "out": args.out, "tma_store": f.tma_store,
                 "ours_ms": ours, "bm128_ms": big,
                 "tflops": flops / ours / 1e9, "weight_gbps": wbytes / ours / 1e6,
                 "of_copy": wbytes / ours / 1e6 / copy, "cublas_block_ms": tb, "cublas_tensor_ms": tt,
                 "vs_cublas_block": (tb / ours) if tb else None,
                 "vs_cublas_tensor": (tt / ours) if tt else None, "tile_ms": both}
            rows.append(r)
            print(f"{name:>15} {n:>5}x{k:<6} {m:>5} {bm:>3}/{bn:<3}{'s' if split else ' '}{chains:<2} {ours * 1e3:8.1f} {r['tflops']:7.0f} "
                  f"{r['weight_gbps']:6.0f} {100 * r['of_copy']:4.0f}% "
                  f"{(tb * 1e3 if tb else float('nan')):9.1f} {(r['vs_cublas_block'] or float('nan')):8.2f} "
                  f"{(tt * 1e3 if tt else float('nan')):9.1f}"
                  + (f"  (64: {both[64] * 1e3:.1f}, 128: {both[128] * 1e3:.1f})" if both else "")
                  + (f"  bm128 {big * 1e3:.1f} us ({100 * wbytes / big / 1e6 / copy:.0f}%)" if big else ""), flush=True)
            del qa, sa, qw, sw, y
    report(args.json, {"device": torch.cuda.get_device_name(0), "copy_gbps": copy, "sms": g.sms, "stages": {f"{bm}x{bn}_{o}": v for (bm, bn, o), v in STAGES.items()},
                       "defines": os.environ.get("TANDEM_LOOP_DEFINES", ""),
                       "flush": "write" if os.environ.get("TANDEM_FLUSH") == "write" else "read", "rows": rows}, failures)


if __name__ == "__main__":
    main()
