"""Bit comparison of two trees' sparse MLA kernels (engine/kernels/sparse_mla.cu): a change that should not move a
bit (an instruction swap, a schedule with the same operations in the same order) is checked on the device by
saving one tree's outputs and comparing the other's.

  python3 bench/gpu/sparse_bits.py save TREE OUT.npz     # TREE: a checkout (its engine/kernels, bench/gpu, scripts)
  python3 bench/gpu/sparse_bits.py compare A.npz B.npz   # exit status 1 when any array differs

Saved: the staged and gathering forms' outputs (bf16 bits) and lse on fixed inputs: 512 queries at the end of an
8K context, 256 at the end of 32K, and a dense 2048-token prompt (sparse_prefill_bench's Chunk, seed 7). The
outputs start as NaN and a NaN left in them is an error (an element a kernel does not write). Each tree is
compiled by its own scripts/kernel-loop.py: TANDEM_LOOP_COMPILER=nvrtc (the engine's compiler) is honoured by
trees from 2026-11-28 on, older ones use nvcc; copy this tree's kernel-loop.py into an older one to compare like
with like.
"""
import os
import sys

import numpy as np


def save(root, out):
    import torch

    sys.path.insert(0, os.path.join(os.path.abspath(root), "bench", "gpu"))
    import sparse_prefill_bench as spb  # noqa: E402 (the tree's own bench and kernels)

    forms = spb.Forms()
    arrays = []
    for ctx, s_q, dense in [(8192, 512, False), (32768, 256, False), (2048, 2048, True)]:
        ch = spb.Chunk(ctx, s_q, dense=dense, seed=7)
        for form in range(2):  # staged, gathering
            o = torch.full((ch.s_q, spb.HEADS, spb.DV), float("nan"), dtype=torch.bfloat16, device="cuda")
            lse = torch.full((ch.s_q, spb.HEADS), float("nan"), dtype=torch.float32, device="cuda")
            ch.launches(forms, o, lse)[form]()
            torch.cuda.synchronize()
            if torch.isnan(o.float()).any() or torch.isnan(lse).any():
                sys.exit(f"ctx {ctx}: form {form} left output elements unwritten (NaN)")
            arrays += [o.view(torch.int16).cpu().numpy(), lse.cpu().numpy()]
    if not out.endswith(".npz"):
        out += ".npz"  # what np.savez writes
    np.savez(out, *arrays)
    print(f"{out}: {len(arrays)} arrays")


def compare(a, b):
    x, y = np.load(a), np.load(b)
    same = [np.array_equal(x[k], y[k]) for k in x.files] if x.files == y.files else [False]
    print(f"{a} == {b} bit for bit: {all(same)} ({sum(same)}/{len(same)} arrays)")
    return all(same)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "save":
        save(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(0 if compare(sys.argv[2], sys.argv[3]) else 1)
    else:
        sys.exit(__doc__)
