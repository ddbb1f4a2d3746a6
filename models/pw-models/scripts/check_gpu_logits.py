"""Check `pagedweight logits --device cuda` against the committed transformers fixtures.

Run on the GPU machine (torch + safetensors there) with a binary built with `--features cuda`:
    python3 models/pw-models/scripts/check_gpu_logits.py BINARY FIXTURES_DIR --out results.json
Prints, per fixture, max|ours - ref| / max|ref| of the final logits and whether the argmax agrees.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

from safetensors.torch import load_file

TOL = 5e-5  # the same relative budget as the CPU tests


def main():
    p = argparse.ArgumentParser()
    p.add_argument("binary")
    p.add_argument("fixtures")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
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
        results.append({"fixture": name, "rel_max_err": rel, "argmax_equal": same_argmax, "pass": rel <= TOL})
        ok &= rel <= TOL
    json.dump({"device": a.device, "tolerance": TOL, "results": results}, open(a.out, "w"), indent=1)
    print(json.dumps(results, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
