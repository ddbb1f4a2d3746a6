"""f16 baseline for `pagedweight bench-kernels`: cuBLAS (torch) on the same shapes.

Run on the GPU machine in the same call as the Rust bench:
    python3 benches/fp16_baseline.py --out fp16.json
Single blocks: y = x @ W.T, f16, 1/4/8/16 tokens, rotating weight copies
larger than L2, CUDA events over batches of launches (median of 7).
Layers: every expert active, tokens spread evenly, gate_up -> act*up -> down
per expert (what an eager f16 MoE does), same bytes as the Rust layer bench.
"""
import argparse
import json

import torch

SHAPES = [("mixtral", "w1", 14336, 4096), ("mixtral", "w2", 4096, 14336),
          ("qwen2_moe", "gate_up", 2816, 2048), ("qwen2_moe", "down", 2048, 1408),
          ("gemma4", "gate_up", 1408, 2816), ("gemma4", "down", 2816, 704)]
LAYERS = [("mixtral", 8, 4096, 14336, 8, 2), ("qwen2_moe", 60, 2048, 1408, 16, 4), ("gemma4", 128, 2816, 704, 32, 8)]


def timed(fn, launches):
    fn(0)
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for i in range(launches):
            fn(i)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / launches)
    return sorted(times)[3]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rotate-bytes", type=int, default=512 << 20)
    args = p.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    out = []
    for model, name, rows, cols in SHAPES:
        copies = max(2, args.rotate_bytes // (rows * cols * 2))
        ws = [torch.randn(rows, cols, device=dev, dtype=torch.float16) * 0.02 for _ in range(copies)]
        for tokens in (1, 4, 8, 16):
            x = torch.randn(tokens, cols, device=dev, dtype=torch.float16)
            us = timed(lambda i: x @ ws[i % copies].T, 100)
            out.append({"kernel": "fp16", "model": model, "block": name, "shape": [rows, cols], "tokens": tokens,
                        "time_us": us, "effective_gbps": rows * cols * 2 / us / 1e3})
        del ws
    for model, experts, hidden, inter, tokens, top_k in LAYERS:
        gu = [torch.randn(2 * inter, hidden, device=dev, dtype=torch.float16) * 0.02 for _ in range(experts)]
        dn = [torch.randn(hidden, inter, device=dev, dtype=torch.float16) * 0.02 for _ in range(experts)]
        pairs = tokens * top_k
        per = [pairs // experts + (1 if e < pairs % experts else 0) for e in range(experts)]
        xs = [torch.randn(t, hidden, device=dev, dtype=torch.float16) for t in per]
        act = torch.nn.functional.silu if model != "gemma4" else (lambda v: torch.nn.functional.gelu(v, approximate="tanh"))

        def layer(_):
            for e in range(experts):
                if per[e] == 0:
                    continue
                h = xs[e] @ gu[e].T
                g, u = h[:, :inter], h[:, inter:]
                (act(g) * u) @ dn[e].T

        us = timed(layer, 20)
        nbytes = experts * 3 * hidden * inter * 2
        out.append({"kernel": "fp16_layer", "model": model, "experts": experts, "tokens": tokens, "top_k": top_k,
                    "time_us": us, "effective_gbps": nbytes / us / 1e3, "bytes": nbytes})
        del gu, dn
    json.dump(out, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
