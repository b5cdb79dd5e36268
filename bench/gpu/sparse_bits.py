"""Bit comparison of two trees' sparse MLA kernels (engine/kernels/sparse_mla.cu): a change that should not move a
bit (an instruction swap, a schedule with the same operations in the same order) is checked on the device by
saving one tree's outputs and comparing the other's.

  python3 bench/gpu/sparse_bits.py save TREE OUT.npz     # TREE: a checkout (its engine/kernels and bench/gpu)
  python3 bench/gpu/sparse_bits.py compare A.npz B.npz   # exit status 1 when any array differs

Saved: the staged and gathering forms' outputs (bf16 bits) and lse on fixed inputs: 512 queries at the end of an
8K context, 256 at the end of 32K, and a dense 2048-token prompt (sparse_prefill_bench's Chunk, seed 7). Set
TANDEM_LOOP_COMPILER=nvrtc to compile with the engine's compiler.
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
            o = torch.empty(ch.s_q, spb.HEADS, spb.DV, dtype=torch.bfloat16, device="cuda")
            lse = torch.empty(ch.s_q, spb.HEADS, dtype=torch.float32, device="cuda")
            ch.launches(forms, o, lse)[form]()
            torch.cuda.synchronize()
            arrays += [o.view(torch.int16).cpu().numpy(), lse.cpu().numpy()]
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
