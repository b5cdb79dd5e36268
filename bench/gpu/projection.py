"""Projected tokens/s per GPU of the 61-layer DeepSeek-V3.2 model at expert parallelism EP-N, from step times
measured on one GPU with the synthetic model standing for one rank (issue: the graphed decode step, item 4).
A projection, not a measurement: every assumption is a flag and is printed with the result.

  python3 bench/gpu/projection.py --bench engine-bench-v32.json [--bench MORE.json ...] [--accept 0.8]
      [--nvlink-gbps 150] [--rdma-gbps 40] [--overlap 0.8] [--json out.json]
  python3 bench/gpu/projection.py --self-test

Input: engine-bench JSON lines or a JSON list (`engine-bench --model synthetic:v32,experts=L --mtp --json`):
the `decode_batch_B` lines give a speculative decode step's time at batch B (`extra.step_s`, the main model
over token + draft and the MTP layer, lm_head included); `prefill_T` lines give prefill time for T tokens.
The model's `experts=L` says which rank it stands for: N = 256 / L (a rank of EP-N holds L of the 256
experts). With DP attention every rank runs its own batch B; in a balanced steady state the tokens routed
to it from other ranks equal those it sends away, so its expert work is what the single-GPU step measured.

Per decode step, in every MoE layer (the model's layers after the first 3 dense ones, plus the MTP layer's),
a rank sends each of its B x 2 tokens (token + draft) to its 8 experts' ranks and gets the results back:
a pair goes to each of the N ranks with probability 1/N, so (N - 1)/N of the pairs leave the rank, each
with 7168 FP8 bytes + 56 f32 scales out (dispatch) and 7168 bf16 bytes back (combine). Up to 8 ranks share
a node: (min(N, 8) - 1)/N of all pairs travel over NVLink (--nvlink-gbps per GPU per direction) and
(N - 8)/N over RDMA (--rdma-gbps per GPU). Dual-batch overlap hides --overlap of the communication time
behind compute; the rest adds to the step. The MTP layer's MoE also counts for the draft pass. Tokens per step per rank: B x (1 + accept) (MTP: one draft per step, accepted at --accept; random
weights accept ~0%, so the rate is an assumption). Prefill: T tokens per rank per step, 8 pairs per token,
no draft.

Published anchors (for comparison, not checked): DeepSeek 1.85k output tok/s per H800 at decode, 9.2k input
tok/s per H800 at prefill; vLLM 2.2k tok/s per H200 (wide EP); SGLang 6.5k input tok/s per H100 at prefill.
"""
import argparse
import json
import re
import sys

HIDDEN = 7168
EXPERTS = 256
TOP_K = 8
DISPATCH_BYTES = HIDDEN + (HIDDEN // 128) * 4  # FP8 values + one f32 scale per 128
COMBINE_BYTES = 2 * HIDDEN  # bf16
GPUS_PER_NODE = 8
FIRST_DENSE = 3  # first_k_dense_replace


def load(path):
    """engine-bench output: one JSON object per line, or a JSON list."""
    text = open(path).read().strip()
    if text.startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def ep_of(model):
    """EP size the measured model stands for, from its `experts=L` (all 256 experts: EP-1)."""
    m = re.search(r"experts=(\d+)", model or "")
    local = int(m.group(1)) if m else EXPERTS
    if EXPERTS % local:
        raise ValueError(f"{model}: experts={local} does not divide {EXPERTS}")
    return EXPERTS // local


def layers_of(model):
    """Decoder layers of the measured model (`layers=N`, default 61)."""
    m = re.search(r"layers=(\d+)", model or "")
    return int(m.group(1)) if m else 61


def moe_layers(model):
    """MoE layers a step passes through: the decoder layers after the first 3 dense ones, plus the MTP layer."""
    return max(0, layers_of(model) - FIRST_DENSE) + 1


def comm_seconds(tokens, n, nvlink_gbps, rdma_gbps, layers=1):
    """Seconds one rank spends sending its tokens' pairs to other ranks and getting them back, over `layers`
    MoE layers."""
    if n <= 1:
        return 0.0
    pairs = tokens * TOP_K
    local = pairs * (min(n, GPUS_PER_NODE) - 1) / n
    remote = pairs * max(0, n - GPUS_PER_NODE) / n
    per_pair = DISPATCH_BYTES + COMBINE_BYTES
    return layers * (local * per_pair / (nvlink_gbps * 1e9) + remote * per_pair / (rdma_gbps * 1e9))


def project(rows, accept, nvlink_gbps, rdma_gbps, overlap):
    out = []
    for r in rows:
        name = r.get("bench", "")
        n = ep_of(r.get("model"))
        if name.startswith("decode_batch_"):
            extra = r.get("extra", {})
            if not extra.get("mtp"):
                continue  # a plain step has no draft: measure with --mtp
            b = extra.get("batch") or int(name.rsplit("_", 1)[1])
            step = extra["step_s"]
            comm = comm_seconds(2 * b, n, nvlink_gbps, rdma_gbps, moe_layers(r.get("model")))
            total = step + (1 - overlap) * comm
            out.append({"phase": "decode", "ep": n, "batch": b, "context": extra.get("context"),
                        "step_ms": 1e3 * step, "comm_ms": 1e3 * comm, "exposed_comm_ms": 1e3 * (1 - overlap) * comm,
                        "tokens_per_s_per_gpu": b * (1 + accept) / total})
        elif name.startswith("prefill_"):
            t, secs = r["tokens"], r["seconds"]
            comm = comm_seconds(t, n, nvlink_gbps, rdma_gbps, moe_layers(r.get("model")))
            total = secs + (1 - overlap) * comm
            out.append({"phase": "prefill", "ep": n, "tokens": t, "step_ms": 1e3 * secs, "comm_ms": 1e3 * comm,
                        "exposed_comm_ms": 1e3 * (1 - overlap) * comm, "tokens_per_s_per_gpu": t / total})
    return out


def self_test():
    # Hand-computed cases (independent of comm_seconds' formula):
    # EP-8, batch 64 with MTP: 128 tokens x 8 = 1024 pairs per layer, 7/8 of them to the 7 other GPUs of
    # the node: 896 pairs x 21728 B = 19,468,288 B per layer at 150 GB/s = 129.7886 us; 58 + 1 MoE layers
    # (61 layers) = 7.657527 ms.
    per_pair = 7168 + 56 * 4 + 2 * 7168
    assert per_pair == 21728
    rows = [{"bench": "decode_batch_64", "model": "synthetic:v32,experts=32", "tokens": 64, "seconds": 0.2,
             "extra": {"mtp": True, "batch": 64, "context": 4096, "step_s": 0.025}},
            {"bench": "decode_batch_64", "model": "synthetic:v32,experts=32", "extra": {"mtp": False}},
            {"bench": "prefill_2048", "model": "synthetic:v32,layers=13,experts=8", "tokens": 2048, "seconds": 0.5}]
    p = project(rows, accept=0.8, nvlink_gbps=150, rdma_gbps=40, overlap=0.8)
    assert len(p) == 2, p
    d = p[0]
    assert abs(d["comm_ms"] - 7.657527) < 1e-5, d
    want = 64 * 1.8 / (0.025 + 0.2 * 7.657527e-3)
    assert abs(d["tokens_per_s_per_gpu"] / want - 1) < 1e-6, d
    # EP-32 prefill of 2048 tokens, 13 layers (10 + 1 MoE): 16384 pairs per layer; 7/32 of them (3584) stay
    # in the node, 24/32 (12288) go over RDMA: 3584 x 21728 / 150e9 + 12288 x 21728 / 40e9 = 0.51915 +
    # 6.67484 ms = 7.19399 ms per layer, x 11 = 79.134 ms.
    pre = p[1]
    assert pre["ep"] == 32 and abs(pre["comm_ms"] - 79.134) < 1e-2, pre
    assert ep_of("synthetic:v32") == 1 and comm_seconds(100, 1, 1, 1) == 0.0
    assert moe_layers("synthetic:v32") == 59 and moe_layers("synthetic:v32,layers=2") == 1
    try:
        ep_of("synthetic:v32,experts=3")
    except ValueError:
        pass
    else:
        raise AssertionError("experts=3 must be refused")
    print("projection self-test passed")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", action="append", default=[], help="engine-bench JSON (repeatable)")
    ap.add_argument("--accept", type=float, default=0.8, help="assumed MTP acceptance rate")
    ap.add_argument("--nvlink-gbps", type=float, default=150.0, help="GB/s per GPU per direction inside a node")
    ap.add_argument("--rdma-gbps", type=float, default=40.0, help="GB/s per GPU between nodes (assumed)")
    ap.add_argument("--overlap", type=float, default=0.8, help="fraction of communication hidden by DBO")
    ap.add_argument("--json")
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    if a.self_test:
        return self_test()
    if not a.bench:
        sys.exit("projection.py: give --bench FILE (engine-bench --json output), or --self-test")
    rows = [r for f in a.bench for r in load(f)]
    p = project(rows, a.accept, a.nvlink_gbps, a.rdma_gbps, a.overlap)
    if not p:
        sys.exit("projection.py: no decode (--mtp) or prefill lines in the input")
    print(f"assumptions: MTP acceptance {a.accept}, NVLink {a.nvlink_gbps} GB/s, RDMA {a.rdma_gbps} GB/s per GPU, "
          f"{a.overlap:.0%} of communication overlapped, {GPUS_PER_NODE} GPUs per node")
    print(f"{'phase':<8} {'EP':>3} {'batch/tok':>9} {'step ms':>8} {'comm ms':>8} {'tok/s/GPU':>10}")
    for r in p:
        size = r.get("batch", r.get("tokens"))
        print(f"{r['phase']:<8} {r['ep']:>3} {size:>9} {r['step_ms']:>8.2f} {r['comm_ms']:>8.2f} "
              f"{r['tokens_per_s_per_gpu']:>10.0f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"assumptions": vars(a), "projection": p}, f, indent=1)


if __name__ == "__main__":
    main()
