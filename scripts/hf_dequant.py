"""Shared by scripts/hf_golden.py and scripts/hf_crosscheck.py: an FP8 checkpoint dequantized for HF transformers.

transformers 5.17's own CPU FP8 dequantizer refuses partial 128x128 blocks (DeepSeek's checkpoints and the
golden one have them), so this multiplies each e4m3 weight by its block scale itself (partial blocks
cropped) and writes a float32 copy with the quantization_config removed.
"""
import json
import os
import tempfile

import torch
from safetensors.torch import load_file, save_file


def dequantized_copy(src):
    """Writes a float32 copy of the checkpoint at `src` into a new temporary folder; returns (folder, config)."""
    dst = tempfile.mkdtemp()
    index = json.load(open(os.path.join(src, "model.safetensors.index.json")))
    tensors = {}
    for f in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(os.path.join(src, f)))
    plain = {}
    for k, v in tensors.items():
        if k.endswith("_scale_inv"):
            continue
        if v.dtype == torch.float8_e4m3fn:
            r, c = v.shape
            s = tensors[k + "_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)[:r, :c]
            plain[k] = (v.float() * s).contiguous()
        else:
            plain[k] = v.float().contiguous()
    save_file(plain, os.path.join(dst, "model.safetensors"))
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "float32"
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return dst, cfg
