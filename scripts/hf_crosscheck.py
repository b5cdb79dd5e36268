"""Cross-checks a tandem checkpoint against Hugging Face transformers (needs torch + transformers).

  python3 scripts/hf_crosscheck.py CHECKPOINT_DIR PROMPT_IDS_FILE OURS_LOGITS_F32

- loads the checkpoint's config and tokenizer with transformers' Auto classes, unchanged, and applies the
  chat template;
- dequantizes the FP8 weights (weight x 128x128 block scale, partial blocks cropped: transformers 5.17's
  own CPU dequantizer refuses partial blocks, also for DeepSeek's real checkpoints), loads that with
  AutoModelForCausalLM in float32 and compares its logits over the prompt with tandem's full-precision
  logits (a raw little-endian f32 file, [positions, vocab]);
- prints HF's 16 greedy tokens after the first 40 prompt tokens, to compare with
  `tandem generate --precision full --prompt-ids ... --max-tokens 16 --ignore-eos --json`.
"""
import json, os, sys

import numpy as np
import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_dequant import dequantized_copy  # noqa: E402

src, ids_file, ours_file = sys.argv[1:4]
ids = [int(x) for x in open(ids_file).read().strip().split(",")]
rep = {"transformers": transformers.__version__}

tok = transformers.AutoTokenizer.from_pretrained(src)
rep["encode"] = tok("Hello there, tandem!")["input_ids"]
rep["chat"] = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
rep["config_class"] = type(transformers.AutoConfig.from_pretrained(src)).__name__

dst, cfg = dequantized_copy(src)
model = transformers.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
with torch.no_grad():
    hf = model(torch.tensor([ids])).logits[0].float().numpy()
ours = np.fromfile(ours_file, dtype="<f4").reshape(len(ids), -1)
diff = np.abs(ours - hf)
rep["max_abs_logit_diff"] = float(diff.max())
rep["argmax_agree"] = f"{int((ours.argmax(1) == hf.argmax(1)).sum())}/{len(ids)}"
rep["hf_greedy_after_40"] = model.generate(torch.tensor([ids[:40]]), max_new_tokens=16, do_sample=False)[0, 40:].tolist()
print(json.dumps(rep, indent=1))
