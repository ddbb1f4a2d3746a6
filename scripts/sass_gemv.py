#!/usr/bin/env python3
"""Static SASS figures of the expert GEMV launches `pw-bench sass-gemv` wrote (and the registers
of its matrix-unit launches: grouped expert GEMM, prefill attention).

For each `.cu` in DIR (see its `index.json`): `nvcc -cubin -arch=sm_90a -Xptxas -v` gives
registers, spills and stack; `cuobjdump -sass` gives the machine code, in which the inner loops
(innermost backward branches) are the GEMV's steps, one per bit-width body. A step covers
`rows · words_per_lane · 32` weights per thread, so its instruction count over that is the
instructions per weight the issue asks to count (at 3 bits the H200 issues ~3 per weight at
full bandwidth: 132 SMs · 4 schedulers · 1.98 GHz · 32 lanes over 11.2 T weights/s).
The bit-width of a loop is read off its plane-word loads (`LDG`: rows · words_per_lane · bits
per step, twice that with prefetch's next step in flight not counted separately).

Writes DIR/sass.json and prints a table. Needs nvcc, cuobjdump and nvdisasm on PATH (PyPI:
nvidia-cuda-nvcc, nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm).
"""
import json
import os
import re
import subprocess
import sys

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);")


def compile_cu(path, cubin):
    out = subprocess.run(
        ["nvcc", "-cubin", "-arch=sm_90a", "-Xptxas", "-v", "-diag-suppress", "68,177,550", "-o", cubin, path],
        capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"nvcc {path}: {out.stderr[-2000:]}")
    info = out.stderr
    regs = re.search(r"Used (\d+) registers", info)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    stack = re.search(r"(\d+) bytes stack frame", info)
    return {
        "registers": int(regs.group(1)) if regs else None,
        "spill_stores": int(spill.group(1)) if spill else None,
        "spill_loads": int(spill.group(2)) if spill else None,
        "stack_bytes": int(stack.group(1)) if stack else None,
    }


def sass(cubin):
    out = subprocess.run(["cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True)
    ins = []
    for line in out.stdout.splitlines():
        m = LINE.search(line)
        if m:
            ins.append((int(m.group(1), 16), m.group(3), m.group(4)))
    return ins


def inner_loops(ins):
    """Innermost loops: (start, end) of backward branches holding no other backward branch."""
    loops = []
    for addr, op, args in ins:
        if op.startswith("BRA"):
            t = re.search(r"0x([0-9a-f]+)", args)
            if t and int(t.group(1), 16) < addr:
                loops.append((int(t.group(1), 16), addr))
    loops = sorted(set(loops))
    return [(s, e) for (s, e) in loops if not any(s <= s2 and e2 <= e and (s2, e2) != (s, e) for (s2, e2) in loops)]


def classify(body):
    def count(p):
        return sum(1 for _, op, _ in body if op.split(".")[0] == p)

    return {
        "instructions": len(body), "ldg": count("LDG"), "shfl": count("SHFL"), "lds": count("LDS"),
        "ffma": count("FFMA"), "lop3": count("LOP3"), "shf": count("SHF"), "imad": count("IMAD"),
        "iadd": count("IADD3") + count("VIADD"), "hadd2": count("HADD2"), "bar": count("BAR"),
    }


def main():
    d = sys.argv[1]
    index = json.load(open(os.path.join(d, "index.json")))
    results = []
    others = []
    for rec in index:
        if rec.get("grouped") or rec.get("attention"):
            # The matrix-unit kernels: registers, spills and stack only.
            cu = os.path.join(d, rec["name"] + ".cu")
            cubin = os.path.join(d, rec["name"] + ".cubin")
            r = dict(rec)
            r.update(compile_cu(cu, cubin))
            others.append(r)
            os.remove(cubin)
            continue
        if not rec.get("gemv"):
            continue
        cu = os.path.join(d, rec["name"] + ".cu")
        cubin = os.path.join(d, rec["name"] + ".cubin")
        r = dict(rec)
        r.update(compile_cu(cu, cubin))
        ins = sass(cubin)
        r["sass_instructions"] = len(ins)
        per_step = rec["rows"] * rec["words_per_lane"] * 32
        loops = []
        for s, e in inner_loops(ins):
            body = [i for i in ins if s <= i[0] <= e]
            c = classify(body)
            # A GEMV step loads rows · words_per_lane plane words per plane.
            if c["ldg"] == 0 or c["ldg"] % (rec["rows"] * rec["words_per_lane"]) != 0 or c["ffma"] < per_step:
                continue
            c["bits"] = c["ldg"] // (rec["rows"] * rec["words_per_lane"])
            c["instructions_per_weight"] = round(c["instructions"] / per_step, 2)
            c["ffma_per_weight"] = round(c["ffma"] / per_step, 2)
            c["lookups_per_weight"] = round((c["shfl"] + c["lds"]) / per_step, 2)
            loops.append(c)
        r["steps"] = sorted(loops, key=lambda c: c["bits"])
        results.append(r)
        os.remove(cubin)
    json.dump(results + others, open(os.path.join(d, "sass.json"), "w"), indent=1)
    print("| launch | regs | spills | cubes/SM × warps | instr/weight at bits (3,4,…) |")
    print("|---|---|---|---|---|")
    for r in results:
        steps = ", ".join(f"{c['bits']}b {c['instructions_per_weight']}" for c in r["steps"])
        print(f"| {r['name']} | {r['registers']} | {r['spill_stores']} | {r['cubes_per_sm']} × {r['warps']} | {steps} |")

    print()
    print("| matrix-unit launch | regs | spill stores / loads | stack |")
    print("|---|---|---|---|")
    for r in others:
        print(f"| {r['name']} | {r['registers']} | {r['spill_stores']} / {r['spill_loads']} | {r['stack_bytes']} |")


if __name__ == "__main__":
    main()
