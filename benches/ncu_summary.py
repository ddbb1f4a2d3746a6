"""Per-kernel totals of an `ncu --csv --metrics gpu__time_duration.sum` capture (markdown table).

Usage: python3 benches/ncu_summary.py ncu-decode.csv
"""
import collections
import csv
import sys

UNITS = {"nsecond": 1, "ns": 1, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6}

lines = [l for l in open(sys.argv[1]) if l.startswith('"')]
agg = collections.defaultdict(lambda: [0, 0.0])
for r in csv.DictReader(lines):
    ns = float(r["Metric Value"].replace(",", "")) * UNITS[r["Metric Unit"]]
    a = agg[r["Kernel Name"].split("(")[0]]
    a[0] += 1
    a[1] += ns
total = sum(t for _, t in agg.values())
print(f"{sum(n for n, _ in agg.values())} kernels, {total / 1e3:.0f} µs of GPU time\n")
print("| kernel | launches | total µs | mean µs | share |\n|---|---|---|---|---|")
for k, (n, t) in sorted(agg.items(), key=lambda x: -x[1][1]):
    print(f"| `{k}` | {n} | {t / 1e3:.1f} | {t / n / 1e3:.2f} | {100 * t / total:.1f} % |")
