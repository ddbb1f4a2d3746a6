#!/usr/bin/env python3
"""Seeded reference fixtures for the pw-models tests.

Builds tiny random Mixtral, Qwen2-MoE and Gemma-4 (text MoE) models with transformers,
randomises norm weights, biases and router scales (so that `w` vs `1 + w` or a missing bias
shows), runs them in f32 on the CPU and writes, per model:

  <name>/              the checkpoint (save_pretrained; some variants fused / sharded / f16)
  <name>/ref.safetensors
      input_ids [T] (i64), logits [T, V], hidden.<i> [T, H] (0 = embedding output, i = output of
      layer i-1), router.<l>.idx [T, K] (i64), router.<l>.weights [T, K], router.<l>.probs [T, E],
      generated [N] (i64, greedy continuation by HF generate with its KV cache)

Seeds are searched until every router's k-th and (k+1)-th probabilities are well separated, so
that top-k choices are stable across implementations.

Usage: python3 make_fixtures.py --out DIR   (writes DIR/fixtures.tar and DIR/hf_src.tar)
"""

import argparse
import copy
import json
import os
import shutil
import sys
import tarfile
import traceback

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

T = 20  # longer than the Gemma sliding window (8)
GEN = 8
MIN_GAP = 3e-4


def build(cfg):
    try:
        return AutoModelForCausalLM.from_config(
            cfg, attn_implementation="eager", experts_implementation="eager"
        )
    except TypeError:
        return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")


def randomise(model, gen):
    """Non-trivial norms, biases and router scales; larger router weights for clear top-k."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("router.scale"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("per_expert_scale"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("gate.weight") or name.endswith("router.proj.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.5 + torch.rand(b.shape, generator=gen))


def moe_blocks(model):
    """(layer index, kind, module) of every routed block."""
    out = []
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer, "router"):
            out.append((i, "gemma", layer.router))
        else:
            blk = getattr(layer, "block_sparse_moe", None) or getattr(layer, "mlp", None)
            if blk is not None and hasattr(blk, "gate"):
                out.append((i, "softmax", blk))
    return out


def run_reference(model, ids, top_k, renorm, eps):
    """Logits, per-layer hidden states and our own recomputation of the router choices."""
    hidden = {}
    router_in = {}
    hooks = []
    hooks.append(
        model.model.embed_tokens.register_forward_hook(
            lambda m, i, o: hidden.__setitem__(0, o[0].detach().clone())
        )
    )
    for li, layer in enumerate(model.model.layers):
        hooks.append(
            layer.register_forward_hook(
                lambda m, i, o, li=li: hidden.__setitem__(
                    li + 1, (o[0] if isinstance(o, tuple) else o)[0].detach().clone()
                )
            )
        )
    for li, kind, mod in moe_blocks(model):
        hooks.append(
            mod.register_forward_hook(
                lambda m, i, o, li=li: router_in.__setitem__(li, i[0].reshape(-1, i[0].shape[-1]).detach().clone())
            )
        )
    with torch.no_grad():
        out = model(input_ids=ids[None], use_cache=False)
    for h in hooks:
        h.remove()
    tensors = {"logits": out.logits[0].float().contiguous()}
    for i, h in hidden.items():
        tensors[f"hidden.{i}"] = h.float().contiguous()
    min_gap = 1e9
    for li, kind, mod in moe_blocks(model):
        x = router_in[li].float()
        if kind == "gemma":
            xn = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5)
            xn = xn * mod.scale.float() * (x.shape[-1] ** -0.5)
            probs = F.softmax(F.linear(xn, mod.proj.weight.float()), dim=-1)
        else:
            probs = F.softmax(F.linear(x, mod.gate.weight.float()), dim=-1)
        sorted_p, _ = probs.sort(dim=-1, descending=True)
        min_gap = min(min_gap, (sorted_p[:, top_k - 1] - sorted_p[:, top_k]).min().item())
        w, idx = torch.topk(probs, top_k, dim=-1)
        if renorm:
            w = w / w.sum(-1, keepdim=True)
        if kind == "gemma":
            w = w * mod.per_expert_scale.float()[idx]
        tensors[f"router.{li}.idx"] = idx.to(torch.int64).contiguous()
        tensors[f"router.{li}.weights"] = w.contiguous()
        tensors[f"router.{li}.probs"] = probs.contiguous()
    return tensors, min_gap


def greedy(model, ids):
    with torch.no_grad():
        g = model.generate(
            ids[None], max_new_tokens=GEN, do_sample=False, use_cache=True, pad_token_id=0
        )
    return g[0, ids.shape[0]:].to(torch.int64).contiguous()


def rounded(model, dtype):
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(p.to(dtype).float())
        # Persistent weights only: rotary inv_freq buffers stay f32, as in transformers.
        for name, b in m.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(b.to(dtype).float())
    return m


def family(name, make_cfg, top_k, renorm, eps, out, variants):
    for seed in range(40):
        torch.manual_seed(seed)
        gen = torch.Generator().manual_seed(1000 + seed)
        model = build(make_cfg()).float().eval()
        randomise(model, gen)
        vocab = model.config.get_text_config().vocab_size
        ids = torch.randint(3, vocab, (T,), generator=gen)
        ref, gap = run_reference(model, ids, top_k, renorm, eps)
        gaps = [gap]
        extra = {}
        for v in variants:
            if v.get("dtype") is not None:
                m2 = rounded(model, v["dtype"])
                r2, g2 = run_reference(m2, ids, top_k, renorm, eps)
                gaps.append(g2)
                extra[v["name"]] = (m2, r2)
        if min(gaps) >= MIN_GAP:
            break
        print(f"{name}: seed {seed} min router gap {min(gaps):.2e}, retrying", flush=True)
    print(f"{name}: seed {seed}, min router gap {min(gaps):.2e}", flush=True)

    ref["input_ids"] = ids.to(torch.int64)
    ref["generated"] = greedy(model, ids)
    d = os.path.join(out, name)
    model.save_pretrained(d)
    save_file(ref, os.path.join(d, "ref.safetensors"))

    for v in variants:
        vd = os.path.join(out, v["name"])
        try:
            if v.get("dtype") is not None:
                m2, r2 = extra[v["name"]]
                r2["input_ids"] = ids.to(torch.int64)
                r2["generated"] = greedy(m2, ids)
                m2.to(v["dtype"]).save_pretrained(vd, **v.get("save_kwargs", {}))
                save_file(r2, os.path.join(vd, "ref.safetensors"))
            elif v.get("fused"):
                # In-memory transformers 5 layout: fused experts, no per-expert split on save.
                os.makedirs(vd, exist_ok=True)
                shutil.copy(os.path.join(d, "config.json"), vd)
                sd = {k: t.contiguous() for k, t in model.state_dict().items() if k != "lm_head.weight" or not model.config.tie_word_embeddings}
                save_file(sd, os.path.join(vd, "model.safetensors"), metadata={"format": "pt"})
            elif v.get("sharded"):
                model.save_pretrained(vd, max_shard_size=v["sharded"])
            elif v.get("multimodal"):
                v["multimodal"](model, vd)
            print(f"{v['name']}: written", flush=True)
        except Exception:
            traceback.print_exc()
            print(f"{v['name']}: FAILED", flush=True)


def mixtral_cfg():
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        rope_theta=1e6, rms_norm_eps=1e-5, sliding_window=None, tie_word_embeddings=False,
        initializer_range=0.1, max_position_embeddings=256,
    )


def qwen_cfg():
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=16, shared_expert_intermediate_size=40, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[1], rope_theta=1e6, rms_norm_eps=1e-6,
        tie_word_embeddings=False, initializer_range=0.1, use_sliding_window=False,
        max_position_embeddings=256,
    )


def gemma_cfg():
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

    return Gemma4TextConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
        num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
        },
        final_logit_softcapping=2.0, hidden_size_per_layer_input=0, enable_moe_block=True,
        num_experts=4, top_k_experts=2, moe_intermediate_size=16, rms_norm_eps=1e-6,
        initializer_range=0.2, max_position_embeddings=256, tie_word_embeddings=True,
    )


def gemma_multimodal(text_model, vd):
    from transformers.models.gemma4.configuration_gemma4 import Gemma4Config
    from transformers.models.gemma4.modeling_gemma4 import Gemma4ForConditionalGeneration

    cfg = Gemma4Config(text_config=text_model.config.to_dict(), vision_config=None, audio_config=None)
    mm = Gemma4ForConditionalGeneration(cfg).float().eval()
    missing = mm.model.language_model.load_state_dict(text_model.model.state_dict(), strict=False)
    print("gemma4 multimodal load:", missing, flush=True)
    mm.save_pretrained(vd)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    work = os.path.join(args.out, "work")
    os.makedirs(work, exist_ok=True)
    print("transformers", transformers.__version__, "torch", torch.__version__, flush=True)
    torch.set_num_threads(8)

    jobs = [
        ("mixtral", mixtral_cfg, 2, True, 1e-5, [
            {"name": "mixtral_fused", "fused": True},
            {"name": "mixtral_f16", "dtype": torch.float16},
        ]),
        ("qwen2_moe", qwen_cfg, 3, False, 1e-6, [
            {"name": "qwen2_moe_bf16", "dtype": torch.bfloat16, "save_kwargs": {"max_shard_size": "40KB"}},
        ]),
        ("gemma4", gemma_cfg, 2, True, 1e-6, [
            {"name": "gemma4_mm", "multimodal": gemma_multimodal},
        ]),
    ]
    for name, make_cfg, k, renorm, eps, variants in jobs:
        try:
            family(name, make_cfg, k, renorm, eps, work, variants)
        except Exception:
            traceback.print_exc()
            print(f"{name}: FAILED", flush=True)

    with tarfile.open(os.path.join(args.out, "fixtures.tar"), "w") as tf:
        tf.add(work, arcname="fixtures")
    shutil.rmtree(work)

    # The exact modeling sources these references came from, for reading only.
    src = os.path.dirname(transformers.__file__)
    with tarfile.open(os.path.join(args.out, "hf_src.tar"), "w") as tf:
        for rel in [
            "models/mixtral", "models/qwen2_moe", "models/gemma4", "modeling_rope_utils.py",
            "masking_utils.py", "integrations/moe.py", "conversion_mapping.py",
        ]:
            p = os.path.join(src, rel)
            if os.path.exists(p):
                tf.add(p, arcname=rel)
    for root, _, files in os.walk(args.out):
        for f in files:
            print(os.path.join(root, f), os.path.getsize(os.path.join(root, f)))


if __name__ == "__main__":
    sys.exit(main())
