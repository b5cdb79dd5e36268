"""Benchmark of the bf16-weight products on the tensor cores (engine/kernels/bf16_mma.cu): DeepSeek-V3.2's bf16
linears (lm_head, the MTP layer's eh_proj) and the absorbed MLA projections (W_UK^T q_nope into bf16 with the
rope part copied, W_UV lat in f32; 128 heads), next to the CUDA-core kernels they replace (engine/kernels/
model.cu), cuBLAS bf16 through torch (activations rounded to bf16 once: half our MMA work, and not the same
numbers) and the same-run copy bandwidth.

  python3 bench/gpu/bf16_bench.py [--quick] [--json FILE]

Each timing is a CUDA-graph replay of one launch after a 256 MiB read that evicts the L2 (bench/gpu/torch_timing.py),
median of the runs.
"weight %copy" = weight bytes / time against the copy (the figure of merit for few rows). Before timing, the
script checks every kernel against f64 sums (the split's bound: 2^-16 of the magnitude sum) and that a row's
bits do not depend on the row count.
"""
import argparse
import os
import sys

try:
    import torch
except ImportError:  # pragma: no cover - the GPU machine has PyTorch
    sys.exit("bf16_bench.py needs PyTorch (installed on the GPU machine)")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_driver import DEV, I, L, P, build, check, cuda, launcher, report  # noqa: E402
from torch_timing import copy_gbps, timed  # noqa: E402

# engine::cuda::bf16_mma; BF16_DEFINES (e.g. "-DBMMA_ROWS=64 -DBMMA_STAGES=2") times a variant of the kernel.
DEFINES = os.environ.get("BF16_DEFINES", "").split()
_D = dict(d[2:].split("=") for d in DEFINES if d.startswith("-D") and "=" in d)
ROWS, N, K, STAGES = int(_D.get("BMMA_ROWS", 32)), 128, 64, int(_D.get("BMMA_STAGES", 3))
SHARED = STAGES * (N * (K + 8) * 2 + ROWS * K * 4) + 2 * (2 * ROWS * (K + 8) * 2)
MLA_PROJ_ROWS = 16



class Kernels:
    def __init__(self):
        self.mma = build("bf16_mma.cu", ["tandem_gemm_bf16_mma"], DEFINES)["tandem_gemm_bf16_mma"]
        check(cuda.cuFuncSetAttribute(self.mma, 8, SHARED), "max dynamic shared memory")
        self.old = build("model.cu", ["tandem_gemm_bf16w", "tandem_mla_absorb_q_bf16w", "tandem_mla_up_v_bf16w"])

    def product(self, x, x_row, x_batch, w, w_batch, y, y_row, y_batch, rows, n, k, batch, tail=None):
        """engine::cuda::bf16_mma::launch."""
        t_src, t_row, t_batch, t_n = tail or (0, 0, 0, 0)
        vals = [P(x.data_ptr()), L(x_row), L(x_batch), I(1), P(w.data_ptr()), L(w_batch), P(y.data_ptr()), L(y_row),
                L(y_batch), I(1 if y.dtype == torch.bfloat16 else 0), P(t_src), L(t_row), L(t_batch), I(t_n),
                I(rows), I(n), I(k), P(0)]
        grid = (-(-rows // ROWS), -(-n // N), batch)
        return launcher(self.mma, grid, 256, SHARED, vals, (x, w, y))

    def linear(self, x, w, y):
        m, k = x.shape
        n = w.shape[0]
        return self.product(x, k, 0, w, 0, y, n, 0, m, n, k, 1)

    def linear_old(self, x, w, y):
        m, k = x.shape
        n = w.shape[0]
        vals = [P(x.data_ptr()), I(1), P(w.data_ptr()), P(y.data_ptr()), I(m), I(n), I(k)]
        return launcher(self.old["tandem_gemm_bf16w"], (-(-n // 32), -(-m // 16), 1), 256, 0, vals, (x, w, y))

    def absorb(self, q, w, qb, rows, heads, nope, rd, rank):
        qk = nope + rd
        return self.product(q, heads * qk, qk, w, rank * nope, qb, heads * (rank + rd), rank + rd, rows, rank, nope,
                            heads, tail=(q.data_ptr() + 4 * nope, heads * qk, qk, rd))

    def absorb_old(self, q, w, qb, rows, heads, nope, rd, rank):
        vals = [P(q.data_ptr()), P(w.data_ptr()), P(qb.data_ptr()), I(rows), I(heads), I(nope), I(rd), I(rank)]
        return launcher(self.old["tandem_mla_absorb_q_bf16w"], (heads, -(-rows // MLA_PROJ_ROWS), 1), 256,
                        MLA_PROJ_ROWS * nope * 4, vals, (q, w, qb))

    def up_v(self, lat, w, out, rows, heads, rank, vd):
        return self.product(lat, heads * rank, rank, w, vd * rank, out, heads * vd, vd, rows, vd, rank, heads)

    def up_v_old(self, lat, w, out, rows, heads, rank, vd):
        vals = [P(lat.data_ptr()), P(w.data_ptr()), P(out.data_ptr()), I(rows), I(heads), I(rank), I(vd)]
        return launcher(self.old["tandem_mla_up_v_bf16w"], (heads, -(-rows // MLA_PROJ_ROWS), 1), 256,
                        MLA_PROJ_ROWS * rank * 4, vals, (lat, w, out))


def run(f):
    f()
    torch.cuda.synchronize()


def checks(kern, failures):
    """Against f64 sums, and row bits across row counts."""
    gen = torch.Generator(device=DEV).manual_seed(3)
    for n, k in [(129280, 7168), (7168, 14336), (1000, 72)]:
        w = (torch.rand(n, k, device=DEV, generator=gen) * 2 - 1).to(torch.bfloat16)
        x = (torch.rand(100, k, device=DEV, generator=gen) - 0.5) * torch.exp2(
            torch.randint(-6, 6, (100, k), device=DEV, generator=gen).float())
        y = torch.empty(100, n, device=DEV)
        run(kern.linear(x, w, y))
        cols = torch.arange(0, n, max(1, n // 997), device=DEV)
        ref = x.double() @ w[cols].double().t()
        mag = x.double().abs() @ w[cols].double().abs().t()
        err = ((y[:, cols].double() - ref).abs() / mag).max().item()
        ok = err <= 2 ** -16
        print(f"check {n}x{k}: max |y - f64| / magnitude sum {err:.2e} (bound {2 ** -16:.2e}) {'ok' if ok else 'FAIL'}")
        if not ok:
            failures.append(f"{n}x{k}: error {err:.2e}")
        for m in (1, 33, 64, 99):
            ys = torch.empty(m, n, device=DEV)
            run(kern.linear(x[:m].contiguous(), w, ys))
            if not torch.equal(ys.view(torch.int32), y[:m].view(torch.int32)):
                failures.append(f"{n}x{k}: rows of M = {m} differ from M = 100")
                print(f"check {n}x{k}: M = {m} rows differ FAIL")
        del w, x, y


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--profile", action="store_true",
                    help="launch lm_head at M = 128 and both projections at 2048 rows once each, untimed (for ncu)")
    ap.add_argument("--only", default="", help="comma-separated products to time (lm_head,eh_proj,heads)")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    kern = Kernels()
    if args.profile:
        w = (torch.rand(129280, 7168, device=DEV) - 0.5).to(torch.bfloat16)
        x = torch.rand(128, 7168, device=DEV) - 0.5
        run(kern.linear(x, w, torch.empty(128, 129280, device=DEV)))
        wk = (torch.rand(128, 512, 128, device=DEV) - 0.5).to(torch.bfloat16)
        wv = (torch.rand(128, 128, 512, device=DEV) - 0.5).to(torch.bfloat16)
        q, lat = torch.rand(2048, 128, 192, device=DEV), torch.rand(2048, 128, 512, device=DEV)
        run(kern.absorb(q, wk, torch.empty(2048, 128, 576, device=DEV, dtype=torch.bfloat16), 2048, 128, 128, 64, 512))
        run(kern.up_v(lat, wv, torch.empty(2048, 128, 128, device=DEV), 2048, 128, 512, 128))
        return
    only = set(filter(None, args.only.split(",")))
    failures = []
    if not args.quick:
        checks(kern, failures)
    copy = copy_gbps()
    print(f"same-run copy: {copy:.0f} GB/s; {torch.cuda.get_device_name(0)}", flush=True)
    gen = torch.Generator(device=DEV).manual_seed(1)
    out_rows = []
    ms = [1, 16, 64, 128, 256, 1024, 2048] if not args.quick else [1, 64, 128, 2048]
    print(f"{'product':>10} {'N x K':>13} {'M':>5} {'ours us':>9} {'TFLOPS':>7} {'w %copy':>7} {'old us':>9} "
          f"{'x old':>6} {'cuBLAS bf16 us':>14}", flush=True)

    def row(name, n, k, m, ours, old, cub, wbytes, flops):
        r = {"product": name, "n": n, "k": k, "m": m, "ours_ms": ours, "old_ms": old, "cublas_bf16_ms": cub,
             "tflops": flops / ours / 1e9, "weight_of_copy": wbytes / ours / 1e6 / copy,
             "vs_old": (old / ours) if old else None}
        out_rows.append(r)
        nan = float("nan")
        print(f"{name:>10} {n:>6}x{k:<6} {m:>5} {ours * 1e3:9.1f} {r['tflops']:7.0f} {100 * r['weight_of_copy']:6.0f}% "
              f"{(old * 1e3 if old else nan):9.1f} {(r['vs_old'] or nan):6.1f} {(cub * 1e3 if cub else nan):14.1f}",
              flush=True)

    for name, n, k in [("lm_head", 129280, 7168), ("eh_proj", 7168, 14336)]:
        if only and name not in only:
            continue
        w = (torch.rand(n, k, device=DEV, generator=gen) - 0.5).to(torch.bfloat16)
        for m in ms:
            x = torch.rand(m, k, device=DEV, generator=gen) - 0.5
            y = torch.empty(m, n, device=DEV)
            ours = timed(kern.linear(x, w, y), args.reps)
            old = timed(kern.linear_old(x, w, y), 3) if m <= 256 and not args.quick else None
            xb = x.to(torch.bfloat16)
            cub = timed(lambda: torch.matmul(xb, w.t()), args.reps)
            row(name, n, k, m, ours, old, cub, n * k * 2, 2.0 * m * n * k)
            del x, y, xb
        del w
    heads, nope, rd, rank, vd = 128, 128, 64, 512, 128
    wk = (torch.rand(heads, rank, nope, device=DEV, generator=gen) - 0.5).to(torch.bfloat16)
    wv = (torch.rand(heads, vd, rank, device=DEV, generator=gen) - 0.5).to(torch.bfloat16)
    for m in ([1, 16, 64, 128, 512, 2048, 4096] if not args.quick else [1, 64, 2048]) if not only or "heads" in only else []:
        q = torch.rand(m, heads, nope + rd, device=DEV, generator=gen) - 0.5
        qb = torch.empty(m, heads, rank + rd, device=DEV, dtype=torch.bfloat16)
        lat = torch.rand(m, heads, rank, device=DEV, generator=gen) - 0.5
        o = torch.empty(m, heads, vd, device=DEV)
        qn_b = q[:, :, :nope].transpose(0, 1).contiguous().to(torch.bfloat16)
        lat_b = lat.transpose(0, 1).contiguous().to(torch.bfloat16)
        for name, f, fo, n, k, wb, cubf in [
            ("absorb_q", kern.absorb(q, wk, qb, m, heads, nope, rd, rank),
             kern.absorb_old(q, wk, qb, m, heads, nope, rd, rank), rank, nope, wk,
             lambda: torch.bmm(qn_b, wk.transpose(1, 2))),
            ("up_v", kern.up_v(lat, wv, o, m, heads, rank, vd), kern.up_v_old(lat, wv, o, m, heads, rank, vd), vd,
             rank, wv, lambda: torch.bmm(lat_b, wv.transpose(1, 2))),
        ]:
            ours = timed(f, args.reps)
            old = timed(fo, 3) if not args.quick else None
            cub = timed(cubf, args.reps)
            row(name, n, k, m, ours, old, cub, heads * n * k * 2, 2.0 * m * heads * n * k)
        # The projections against f64 (one row tile's worth of rows).
        r = min(m, 40)
        run(kern.absorb(q, wk, qb, m, heads, nope, rd, rank))
        ref = torch.einsum("mhk,hnk->mhn", q[:r, :, :nope].double(), wk.double())
        mag = torch.einsum("mhk,hnk->mhn", q[:r, :, :nope].double().abs(), wk.double().abs())
        err = ((qb[:r, :, :rank].double() - ref).abs() - ref.abs() * 2 ** -8).div(mag).max().item()
        if err > 2 ** -16:
            failures.append(f"absorb_q rows {m}: error {err:.2e}")
        if not torch.equal(qb[:r, :, rank:], q[:r, :, nope:].to(torch.bfloat16)):
            failures.append(f"absorb_q rows {m}: the rope part is not bf16(q_pe)")
        del q, qb, lat, o, qn_b, lat_b
    report(args.json, {"device": torch.cuda.get_device_name(0), "copy_gbps": copy, "defines": DEFINES,
                       "rows": out_rows}, failures)


if __name__ == "__main__":
    main()
