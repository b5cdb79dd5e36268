"""The CUDA driver through ctypes for the GPU benchmarks (bench/gpu/*_bench.py): error checks, kernels built by
nvcc from engine/kernels and loaded as modules, graph-capturable launch closures, and the results file."""
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch

KERNELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "engine", "kernels")
DEV = "cuda"
# ctypes argument types of kernel parameters: pointer, i64, i32.
P, L, I = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32

cuda = ctypes.CDLL("libcuda.so.1")


def check(r, what):
    if r != 0:
        name = ctypes.c_char_p()
        cuda.cuGetErrorName(r, ctypes.byref(name))
        raise RuntimeError(f"{what}: {name.value.decode() if name.value else r}")


def build(src, names, defines=()):
    """engine/kernels/`src` compiled by nvcc for sm_90a (with `defines`) and loaded: {name: CUfunction}."""
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    out = os.path.join(tempfile.gettempdir(), f"tandem-{os.path.basename(src)}.cubin")
    subprocess.run([nvcc, "-cubin", "-arch=sm_90a", "-std=c++17", "-lineinfo", "-I", os.path.abspath(KERNELS),
                    os.path.join(KERNELS, src), "-o", out] + list(defines), check=True)
    torch.zeros(1, device=DEV)  # the primary context, current on this thread
    mod = ctypes.c_void_p()
    check(cuda.cuModuleLoad(ctypes.byref(mod), out.encode()), "cuModuleLoad")
    fns = {}
    for n in names:
        f = ctypes.c_void_p()
        check(cuda.cuModuleGetFunction(ctypes.byref(f), mod, n.encode()), n)
        fns[n] = f
    return fns


def launcher(fn, grid, block, smem, vals, keep):
    """A closure launching `fn` on the current stream with the ctypes values `vals` (`keep`: tensors it uses)."""
    params = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in vals])

    def launch():
        _ = (keep, vals, params)
        stream = torch.cuda.current_stream().cuda_stream
        check(cuda.cuLaunchKernel(fn, *grid, block, 1, 1, smem, ctypes.c_void_p(stream), params, None), "launch")
    return launch


def report(path, out, failures):
    """Writes `out` (with the failures) as JSON to `path` when given, then exits 1 if anything failed."""
    out["failures"] = failures
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    if failures:
        print("FAILURES:\n  " + "\n  ".join(failures))
        sys.exit(1)
