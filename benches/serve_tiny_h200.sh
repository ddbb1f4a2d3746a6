#!/bin/bash
set -u
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
PW=${1:-target/release/pagedweight}   # built with --features cuda
echo "== fast path, 4-bit experts, --once"
$PW serve --fast --bits 4 --device cuda --once "KING HENRY." --max-tokens 128 2>&1 | tail -6
echo "== Burn CUDA path, --once"
$PW serve --device cuda --once "KING HENRY." --max-tokens 128 2>&1 | tail -3
echo "== fast path server, 16 concurrent requests"
$PW serve --fast --bits 4 --device cuda --port 8123 > ${OUT:-/tmp}/server.log 2>&1 &
SP=$!
python3 - <<'PY'
import json, threading, time, urllib.request
for _ in range(120):
    try:
        urllib.request.urlopen("http://127.0.0.1:8123/health", timeout=1); break
    except Exception: time.sleep(0.5)
prompts = ["KING HENRY.", "ROMEO.\nBut soft", "And God said", "HAMLET.", "1 In the beginning", "CHAPTER 3", "JULIET.", "OTHELLO."] * 2
res = [None] * len(prompts)
def go(i, p):
    body = json.dumps({"model": "tiny-mixtral", "prompt": p, "max_tokens": 128, "temperature": 0.8, "seed": i, "ignore_eos": True}).encode()
    r = urllib.request.urlopen(urllib.request.Request("http://127.0.0.1:8123/v1/completions", body, {"Content-Type": "application/json"}), timeout=120)
    res[i] = json.loads(r.read())
t = time.time()
th = [threading.Thread(target=go, args=(i, p)) for i, p in enumerate(prompts)]
[x.start() for x in th]; [x.join() for x in th]
dt = time.time() - t
toks = sum(r["usage"]["completion_tokens"] for r in res if r)
print(json.dumps({"requests": len(prompts), "completed": sum(r is not None for r in res), "completion_tokens": toks, "seconds": round(dt, 2), "tok_s": round(toks / dt, 1)}))
print(repr(res[0]["choices"][0]["text"][:200]))
m = urllib.request.urlopen("http://127.0.0.1:8123/metrics").read().decode()
print("\n".join(l for l in m.splitlines() if l.startswith("pw_") and ("tokens" in l or "kv_bytes" in l or "weight" in l))[:1500])
PY
kill $SP
