"""Check `pagedweight logits --device cuda` against the committed transformers fixtures.

Run on the GPU machine (torch + safetensors there) with a binary built with `--features cuda`:
    python3 models/pw-models/scripts/check_gpu_logits.py BINARY FIXTURES_DIR --out results.json
Prints, per fixture, max|ours - ref| / max|ref| of the final logits and whether the argmax agrees.

With --hf-tf32 it also runs transformers itself on the GPU in f32 with TF32 tensor-core matmuls
allowed and reports that run's error against the same fixture (`hf_tf32_rel_err`): Burn's CUDA
matmul (cubek-matmul's `adjust_dtypes`) stages f32 operands as TF32 on tensor cores, so an error of
the same size in both runs attributes the gap to TF32 rounding, not to a wrong formula.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

from safetensors.torch import load_file

TOL = 5e-5  # the same relative budget as the CPU tests


def hf_gpu_errors(model_dir, ids, want):
    """transformers on the GPU in f32, TF32 matmuls off and on, against the CPU fixture."""
    import torch
    from transformers import AutoModelForCausalLM

    out = {}
    try:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="eager").to("cuda").eval()
    except Exception as e:  # e.g. the multimodal layout needs another class
        return {"hf_error": str(e)[:300]}
    for mode in ("ieee", "tf32"):
        torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
        torch.backends.cudnn.allow_tf32 = mode == "tf32"
        with torch.no_grad():
            got = model(input_ids=ids.view(1, -1).to("cuda")).logits[0].float().cpu()
        out[f"hf_{mode}_rel_err"] = float((got - want).abs().max() / want.abs().max())
    torch.backends.cuda.matmul.allow_tf32 = False
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("binary")
    p.add_argument("fixtures")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    p.add_argument("--hf-tf32", action="store_true")
    a = p.parse_args()
    results, ok = [], True
    for name in sorted(os.listdir(a.fixtures)):
        d = os.path.join(a.fixtures, name)
        ref_dir = d if os.path.exists(os.path.join(d, "ref.safetensors")) else os.path.join(a.fixtures, name.split("_")[0])
        ref_path = os.path.join(ref_dir, "ref.safetensors")
        if not os.path.exists(os.path.join(d, "config.json")) or not os.path.exists(ref_path):
            continue
        ref = load_file(ref_path)
        ids = ",".join(str(int(i)) for i in ref["input_ids"].tolist())
        with tempfile.TemporaryDirectory() as t:
            out = os.path.join(t, "logits.safetensors")
            r = subprocess.run([a.binary, "logits", "--model", d, "--ids", ids, "--out", out, "--device", a.device],
                               capture_output=True, text=True)
            if r.returncode != 0:
                results.append({"fixture": name, "error": r.stderr[-2000:]})
                ok = False
                continue
            ours = load_file(out)["logits"].float()
        want = ref["logits"].float()
        rel = float((ours - want).abs().max() / want.abs().max())
        same_argmax = bool((ours.argmax(-1) == want.argmax(-1)).all())
        rec = {"fixture": name, "rel_max_err": rel, "argmax_equal": same_argmax, "pass": rel <= TOL}
        if a.hf_tf32:
            rec.update(hf_gpu_errors(d, ref["input_ids"], want))
        results.append(rec)
        ok &= rel <= TOL
    json.dump({"device": a.device, "tolerance": TOL, "results": results}, open(a.out, "w"), indent=1)
    print(json.dumps(results, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
