#!/usr/bin/env python3
"""Reference logits of the shipped models from transformers (f32, TF32 off), for the Rust tests.

Run on a machine with torch + transformers 5.17 (the GPU machine):
    python3 scripts/shipped_model_refs.py assets/tiny-mixtral assets/tiny-qwen2-moe
writes MODEL_DIR/ref_logits.safetensors: `input_ids` [T] (i64, the tokenizer's encoding of PROMPT
with <s>) and `logits` [T, V] (f32).
"""
import sys

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

PROMPT = "HAMLET.\nTo be, or not to be, that is the question:\nWhether 'tis nobler in the mind"

torch.backends.cuda.matmul.allow_tf32 = False
dev = "cuda" if torch.cuda.is_available() else "cpu"
for d in sys.argv[1:]:
    ids = Tokenizer.from_file(f"{d}/tokenizer.json").encode(PROMPT).ids
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").to(dev).eval()
    x = torch.tensor([ids], device=dev)
    with torch.no_grad():
        logits = model(input_ids=x).logits[0].float().cpu().contiguous()
    save_file({"input_ids": x[0].cpu(), "logits": logits}, f"{d}/ref_logits.safetensors")
    print(d, len(ids), logits.shape, logits[-1].argmax().item())
