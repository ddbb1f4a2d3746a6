"""Merge `pagedweight bench-kernels` and `fp16_baseline.py` outputs of one GPU run
into benches/results/h200-kernels.json and a markdown table.

    python3 benches/merge_kernel_results.py pw.json fp16.json gpu.txt COMMIT COMMAND > table.md
"""
import datetime
import json
import sys


def main(pw_path, fp16_path, gpu_path, commit, command):
    pw = json.load(open(pw_path))
    fp16 = json.load(open(fp16_path))
    hbm = next(r["hbm_read_gbps"] for r in pw if r["kernel"] == "stream_read")
    f16 = {(r["model"], tuple(r["shape"]), r["tokens"]): r["time_us"] for r in fp16 if r["kernel"] == "fp16"}
    f16_layer = {r["model"]: r["time_us"] for r in fp16 if r["kernel"] == "fp16_layer"}
    records = []
    for r in pw:
        if r["kernel"] == "gemv":
            base = f16.get((r["model"], tuple(r["shape"]), r["tokens"]))
        elif r["kernel"] == "grouped_layer":
            base = f16_layer.get(r["model"])
        else:
            continue
        records.append({"kernel": r["kernel"], "model": r["model"], "shape": r["shape"], "tokens": r["tokens"],
                        "bits": r["bits"], "time_us": round(r["time_us"], 2),
                        "effective_gbps": round(r["effective_gbps"], 1),
                        "fp16_time_us": round(base, 2) if base else None})
    for r in fp16:
        shape = r.get("shape") or [r["experts"], 0, 0]
        records.append({"kernel": "fp16", "model": r["model"], "shape": shape, "tokens": r["tokens"], "bits": 16,
                        "time_us": round(r["time_us"], 2), "effective_gbps": round(r["effective_gbps"], 1),
                        "fp16_time_us": round(r["time_us"], 2), "what": r["kernel"]})
    out = {"date": datetime.date.today().isoformat(), "git_commit": commit, "command": command,
           "gpu": open(gpu_path).read().strip().splitlines()[-1], "hbm_read_gbps": round(hbm, 1),
           "timing": "wall clock over batches of back-to-back launches ending in one sync, median of 7 batches; "
                     "weights rotate through copies larger than L2; f16 baseline: torch/cuBLAS with CUDA events",
           "records": records}
    json.dump(out, open("benches/results/h200-kernels.json", "w"), indent=1)

    print(f"# H200 kernel benchmark\n\n- date: {out['date']}\n- git commit: `{commit}`\n- command: `{command}`")
    print(f"- GPU: {out['gpu']}\n- measured streaming read bound: **{hbm:.0f} GB/s**\n- timing: {out['timing']}\n")
    print("## Grouped layer (two launches: gate_up, then act·up fused into down), all experts active\n")
    print("| model | experts | tokens | bits | time µs | effective GB/s | % of bound | f16 eager µs | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in pw:
        if r["kernel"] == "grouped_layer":
            b = f16_layer.get(r["model"])
            print(f"| {r['model']} | {r['experts']} | {r['tokens']} | {r['bits']} | {r['time_us']:.1f} | "
                  f"{r['effective_gbps']:.0f} | {100 * r['effective_gbps'] / hbm:.0f}% | {b:.1f} | {b / r['time_us']:.2f}× |")
    print("\n## Single block, 1 / 16 tokens (time µs, effective GB/s; f16 = cuBLAS)\n")
    print("| model | shape | bits | t=1 µs | t=1 GB/s | f16 t=1 µs | t=16 µs | t=16 GB/s | f16 t=16 µs |")
    print("|---|---|---|---|---|---|---|---|---|")
    by = {(r["model"], tuple(r["shape"]), r["bits"], r["tokens"]): r for r in pw if r["kernel"] == "gemv"}
    for (m, s, b, t), r in by.items():
        if t != 1:
            continue
        r16 = by[(m, s, b, 16)]
        print(f"| {m} | {s[0]}×{s[1]} | {b} | {r['time_us']:.1f} | {r['effective_gbps']:.0f} | {f16[(m, s, 1)]:.1f} | "
              f"{r16['time_us']:.1f} | {r16['effective_gbps']:.0f} | {f16[(m, s, 16)]:.1f} |")


if __name__ == "__main__":
    main(*sys.argv[1:6])
