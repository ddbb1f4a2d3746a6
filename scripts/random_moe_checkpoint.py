#!/usr/bin/env python3
"""Writes a Hugging Face checkpoint of a full-size MoE shape with random bf16 weights, for
measuring `pagedweight quantize` at scale (issue 29) where the real weights cannot be fetched.

    python3 scripts/random_moe_checkpoint.py --shape qwen1.5-moe-a2.7b --out DIR [--layers N]
        [--torch-device cuda]

Shapes follow the published configs (`--layers` keeps the first N decoder layers at full width,
to measure per layer on a machine too small for the whole model). Tensors are written one
layer per shard with numpy, so the peak memory is one layer, not the model (the
GPU machine's transformers `from_config` + `save_pretrained` would hold it all). The tokenizer
files are copied from `--tokenizer-from` (default: the shipped tiny Qwen2-MoE: its ids are
below every shape's vocabulary).
"""

import argparse
import json
import os
import shutil

import numpy as np

SHAPES = {
    "qwen1.5-moe-a2.7b": {
        "architectures": ["Qwen2MoeForCausalLM"],
        "model_type": "qwen2_moe",
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "norm_topk_prob": False,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "vocab_size": 151936,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "qkv_bias": True,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
    },
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
        "sliding_window": None,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}


class TorchRng:
    """Draws the Gaussians with torch on a device (`--torch-device cuda`): numpy's generator
    takes minutes for the 14 B values of a full-size shape, the GPU a second."""

    def __init__(self, device, seed):
        import torch

        self.torch, self.device = torch, device
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def bf16(self, shape, std):
        t = self.torch.randn(shape, generator=self.gen, device=self.device) * std
        return t.to(self.torch.bfloat16).view(self.torch.int16).cpu().numpy().view(np.uint16)


def bf16(rng, shape, std):
    """Gaussian values rounded to bf16, stored as numpy uint16 viewed by safetensors as BF16."""
    if isinstance(rng, TorchRng):
        return rng.bf16(shape, std)
    x = (rng.standard_normal(shape, dtype=np.float32) * std).view(np.uint32)
    # Round to nearest even on the upper 16 bits.
    x = ((x + 0x7FFF + ((x >> 16) & 1)) >> 16).astype(np.uint16)
    return x


def layer_tensors(cfg, i, rng):
    h = cfg["hidden_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim", h // nh)
    p = f"model.layers.{i}"
    t = {
        f"{p}.input_layernorm.weight": np.ones(h, np.float32),
        f"{p}.post_attention_layernorm.weight": np.ones(h, np.float32),
        f"{p}.self_attn.q_proj.weight": bf16(rng, (nh * hd, h), 0.02),
        f"{p}.self_attn.k_proj.weight": bf16(rng, (nkv * hd, h), 0.02),
        f"{p}.self_attn.v_proj.weight": bf16(rng, (nkv * hd, h), 0.02),
        f"{p}.self_attn.o_proj.weight": bf16(rng, (h, nh * hd), 0.02),
    }
    if cfg["model_type"] == "qwen2_moe":
        for n in ("q", "k", "v"):
            rows = nh * hd if n == "q" else nkv * hd
            t[f"{p}.self_attn.{n}_proj.bias"] = np.zeros(rows, np.float32)
        e, i_moe, i_sh = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
        t[f"{p}.mlp.gate.weight"] = bf16(rng, (e, h), 0.02)
        for x in range(e):
            q = f"{p}.mlp.experts.{x}"
            t[f"{q}.gate_proj.weight"] = bf16(rng, (i_moe, h), 0.02)
            t[f"{q}.up_proj.weight"] = bf16(rng, (i_moe, h), 0.02)
            t[f"{q}.down_proj.weight"] = bf16(rng, (h, i_moe), 0.02)
        q = f"{p}.mlp.shared_expert"
        t[f"{q}.gate_proj.weight"] = bf16(rng, (i_sh, h), 0.02)
        t[f"{q}.up_proj.weight"] = bf16(rng, (i_sh, h), 0.02)
        t[f"{q}.down_proj.weight"] = bf16(rng, (h, i_sh), 0.02)
        t[f"{p}.mlp.shared_expert_gate.weight"] = bf16(rng, (1, h), 0.02)
    else:
        e, i_moe = cfg["num_local_experts"], cfg["intermediate_size"]
        q = f"{p}.block_sparse_moe"
        t[f"{q}.gate.weight"] = bf16(rng, (e, h), 0.02)
        for x in range(e):
            t[f"{q}.experts.{x}.w1.weight"] = bf16(rng, (i_moe, h), 0.02)
            t[f"{q}.experts.{x}.w3.weight"] = bf16(rng, (i_moe, h), 0.02)
            t[f"{q}.experts.{x}.w2.weight"] = bf16(rng, (h, i_moe), 0.02)
    return t


def save(tensors, path, index, name):
    """One safetensors file: the header, then the tensors' bytes in order (uint16 arrays are bf16)."""
    header, offset = {}, 0
    for k, t in tensors.items():
        dtype = "BF16" if t.dtype == np.uint16 else "F32"
        header[k] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in tensors.values():
            f.write(np.ascontiguousarray(t).tobytes())
    for k in tensors:
        index[k] = name


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--torch-device", help="draw the weights with torch on this device (e.g. cuda)")
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--tokenizer-from", default=os.path.join(here, "..", "assets", "tiny-qwen2-moe"))
    a = ap.parse_args()
    cfg = dict(SHAPES[a.shape])
    if a.layers:
        cfg["num_hidden_layers"] = a.layers
    os.makedirs(a.out, exist_ok=True)
    rng = TorchRng(a.torch_device, a.seed) if a.torch_device else np.random.default_rng(a.seed)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    n = cfg["num_hidden_layers"]
    index = {}
    total = n + 1
    save(
        {
            "model.embed_tokens.weight": bf16(rng, (v, h), 0.02),
            "model.norm.weight": np.ones(h, np.float32),
            "lm_head.weight": bf16(rng, (v, h), 0.02),
        },
        os.path.join(a.out, f"model-00001-of-{total:05}.safetensors"),
        index,
        f"model-00001-of-{total:05}.safetensors",
    )
    for i in range(n):
        name = f"model-{i + 2:05}-of-{total:05}.safetensors"
        save(layer_tensors(cfg, i, rng), os.path.join(a.out, name), index, name)
        print(f"layer {i + 1}/{n}", flush=True)
    with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": index}, f)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    for fname in ("tokenizer.json", "tokenizer_config.json", "calib.txt"):
        src = os.path.join(a.tokenizer_from, fname)
        if os.path.exists(src):
            shutil.copy(src, os.path.join(a.out, fname))


if __name__ == "__main__":
    main()
