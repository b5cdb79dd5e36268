"""Golden logits and greedy tokens from Hugging Face transformers under tandem's top-k rule.

  python3 scripts/hf_golden.py CHECKPOINT_DIR OUT_PREFIX (--ids-from GOLDEN.safetensors | --lengths 20,32,...)
      [--seed 0] [--greedy 16] [--check-old GOLDEN.safetensors]

Runs `DeepseekV32ForCausalLM` (float32, CPU) on the checkpoint's dequantized weights (weight x 128x128 block
scale, partial blocks cropped, as scripts/hf_crosscheck.py does) with every indexer top-k replaced by the rule
of docs/model.md §2.6: larger score first, equal scores -> the later position (a stable sort of the reversed row), and
every MoE routing top-k by "equal scores -> the lower index" (a stable sort). Which module calls `topk` is read
off the caller's `self`; the run fails if no indexer top-k was intercepted.

Writes OUT_PREFIX.safetensors (`input_ids_i` int64, `logits_i` float32 [len, vocab] at every position of one
forward, `greedy_i` int64: the tokens plain argmax decoding appends through the KV cache) and OUT_PREFIX.json
(versions, the rule, per sequence: length, greedy tokens, the greedy tokens recomputed without cache, how far the
rule moves the logits from torch's own top-k). With --check-old, torch's own top-k is also run on the old golden's
inputs and its distance to the old logits is reported (it shows the loading and dequantization are unchanged).
"""
import argparse, collections, json, os, sys

import numpy as np
import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_dequant import dequantized_copy  # noqa: E402
from safetensors.numpy import load_file as load_np, save_file as save_np

ap = argparse.ArgumentParser()
ap.add_argument("checkpoint")
ap.add_argument("out_prefix")
ap.add_argument("--ids-from")
ap.add_argument("--lengths")
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--greedy", type=int, default=16)
ap.add_argument("--check-old")
args = ap.parse_args()
torch.set_num_threads(os.cpu_count() or 1)

# ---- the top-k rule --------------------------------------------------------------------------------------
TopK = collections.namedtuple("topk", "values indices")
_tensor_topk, _torch_topk = torch.Tensor.topk, torch.topk
MODE = {"rule": True}
CALLS = collections.Counter()


def caller_kind():
    f = sys._getframe(2)
    for _ in range(6):
        if f is None:
            break
        s = f.f_locals.get("self")
        if s is not None:
            n = type(s).__name__
            if "Indexer" in n:
                return "indexer"
            if any(w in n for w in ("MoE", "Moe", "Router", "Gate", "Expert")):
                return "moe"
        f = f.f_back
    return "other"


def rule_topk(x, k, dim, later_wins):
    dim = dim % x.dim()
    n = x.size(dim)
    if later_wins:
        order = (n - 1) - torch.argsort(x.flip(dim), dim=dim, descending=True, stable=True)
    else:
        order = torch.argsort(x, dim=dim, descending=True, stable=True)
    idx = order.narrow(dim, 0, k)
    return TopK(x.gather(dim, idx), idx)


def dispatch(orig, x, k, dim=-1, largest=True, sorted=True, **kw):
    kind = caller_kind()
    CALLS[kind] += 1
    if MODE["rule"] and kind != "other" and largest and not kw:
        return rule_topk(x, k, dim, later_wins=(kind == "indexer"))
    return orig(x, k, dim, largest, sorted, **kw)


torch.Tensor.topk = lambda self, k, dim=-1, largest=True, sorted=True, **kw: dispatch(
    _tensor_topk, self, k, dim, largest, sorted, **kw
)
torch.topk = lambda x, k, dim=-1, largest=True, sorted=True, **kw: dispatch(_torch_topk, x, k, dim, largest, sorted, **kw)

# ---- the model on dequantized weights ---------------------------------------------------------------------
src = args.checkpoint
dst, cfg = dequantized_copy(src)
model = transformers.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32, attn_implementation="eager").eval()
vocab = cfg["vocab_size"]

if args.ids_from:
    old = load_np(args.ids_from)
    seqs = [old[f"input_ids_{i}"].tolist() for i in range(len([k for k in old if k.startswith("input_ids_")]))]
else:
    rng = np.random.default_rng(args.seed)
    seqs = [[cfg.get("bos_token_id", 0)] + rng.integers(100, vocab, n - 1).tolist() for n in map(int, args.lengths.split(","))]


@torch.no_grad()
def logits_of(ids):
    return model(torch.tensor([ids]), use_cache=False).logits[0].float()


@torch.no_grad()
def greedy_cached(ids, n):
    out = model(torch.tensor([ids]), use_cache=True)
    toks = [int(out.logits[0, -1].argmax())]
    pkv = out.past_key_values
    while len(toks) < n:
        out = model(torch.tensor([[toks[-1]]]), past_key_values=pkv, use_cache=True)
        pkv = out.past_key_values
        toks.append(int(out.logits[0, -1].argmax()))
    return toks


@torch.no_grad()
def greedy_recomputed(ids, n):
    toks = []
    for _ in range(n):
        toks.append(int(logits_of(ids + toks)[-1].argmax()))
    return toks


report = {
    "transformers": transformers.__version__,
    "torch": torch.__version__,
    "checkpoint": os.path.basename(os.path.normpath(src)),
    "rule": "indexer top-k: larger score first, equal scores -> later position; MoE top-k: equal -> lower index",
    "sequences": [],
}
out = {}
for i, ids in enumerate(seqs):
    MODE["rule"] = False
    torch_logits = logits_of(ids)
    MODE["rule"] = True
    logits = logits_of(ids)
    greedy = greedy_cached(ids, args.greedy)
    recomputed = greedy_recomputed(ids, args.greedy)
    out[f"input_ids_{i}"] = np.array(ids, dtype=np.int64)
    out[f"logits_{i}"] = logits.numpy().astype(np.float32)
    out[f"greedy_{i}"] = np.array(greedy, dtype=np.int64)
    report["sequences"].append(
        {
            "index": i,
            "length": len(ids),
            f"greedy_{args.greedy}": greedy,
            "greedy_without_cache_equal": recomputed == greedy,
            "max_abs_rule_vs_torch_topk": float((logits - torch_logits).abs().max()),
        }
    )
if args.check_old:
    old = load_np(args.check_old)
    MODE["rule"] = False
    report["old_golden_max_abs_with_torch_topk"] = [
        float(np.abs(logits_of(old[f"input_ids_{i}"].tolist()).numpy() - old[f"logits_{i}"]).max())
        for i in range(len(seqs))
    ]
report["topk_calls"] = dict(CALLS)
save_np(out, args.out_prefix + ".safetensors")
json.dump(report, open(args.out_prefix + ".json", "w"), indent=1)
print(json.dumps(report, indent=1))
if CALLS["indexer"] == 0:
    sys.exit("no indexer top-k was intercepted: the rule was not applied")
