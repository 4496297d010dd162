"""A small MoE language model trained with fp8_blockwise and with bf16 experts, side by side.

Character-level (bytes) model on the Python standard library's own source (available offline):
embedding -> L x [RMSNorm, causal attention, RMSNorm, MoE (top-2 router + moegemm.GroupedMLP, SwiGLU,
probs applied inside)] -> head. Both runs use the same seed, initial weights and batches; only the
experts' recipe differs. Writes the loss curves as JSON (and a PNG when matplotlib is importable; else
`python -m bench.examples.train_lm --plot lm_loss.json` on any machine), into ~/.cache/moegemm-bench/train_lm/
unless --out names a folder.

    python -m bench.examples.train_lm --steps 300 --out bench/results   # the committed lm_loss.json and .png
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import moegemm
from bench.outputs import describe, out_dir
from bench.preflight import require_module


def load_corpus(max_bytes: int) -> torch.Tensor:
    root = os.path.dirname(os.__file__)
    data = bytearray()
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        if "site-packages" in path or "test" in path:
            continue
        with open(path, "rb") as f:
            data += f.read()
        if len(data) >= max_bytes:
            break
    return torch.frombuffer(bytes(data[:max_bytes]), dtype=torch.uint8).long()


class MoE(nn.Module):
    def __init__(self, d, ffn, experts, top_k, recipe):
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = moegemm.GroupedMLP(experts, d, ffn, activation="swiglu", recipe=recipe, dtype=torch.float32)
        self.E, self.top_k = experts, top_k

    def forward(self, x):  # x [T, d]
        T = x.shape[0]
        logits = self.router(x).float()
        probs_all = logits.softmax(-1)
        probs, eid = probs_all.topk(self.top_k, dim=-1)  # [T, k]
        probs = probs / probs.sum(-1, keepdim=True)
        flat_e = eid.reshape(-1)
        order = torch.argsort(flat_e, stable=True)  # tokens sorted by expert, on the device
        token = torch.arange(T, device=x.device).repeat_interleave(self.top_k)[order]
        m_splits = torch.bincount(flat_e, minlength=self.E)  # device tensor, never read on the host
        y = self.experts(x[token].to(torch.bfloat16), m_splits, probs.reshape(-1)[order])
        out = torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))
        # Switch-style load-balancing loss
        frac = torch.zeros(self.E, device=x.device).index_add_(0, flat_e, torch.ones_like(flat_e, dtype=torch.float32))
        aux = self.E * (frac / flat_e.numel() * probs_all.mean(0)).sum()
        return out, aux


class Block(nn.Module):
    def __init__(self, d, heads, ffn, experts, top_k, recipe):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.moe = MoE(d, ffn, experts, top_k, recipe)
        self.heads = heads

    def forward(self, x):  # [B, S, d]
        B, S, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(B, S, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, d)
        x = x + self.proj(att)
        y, aux = self.moe(self.n2(x).reshape(B * S, d))
        return x + y.view(B, S, d), aux


class MoELM(nn.Module):
    def __init__(self, d=512, layers=2, heads=8, ffn=1024, experts=8, top_k=2, seq=256, recipe="fp8_blockwise"):
        super().__init__()
        self.emb = nn.Embedding(256, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads, ffn, experts, top_k, recipe) for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(d), nn.Linear(d, 256, bias=False)

    def forward(self, idx):
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        aux = 0.0
        for blk in self.blocks:
            x, a = blk(x)
            aux = aux + a
        return self.head(self.norm(x)), aux


def train(recipe, data, args, device):
    torch.manual_seed(args.seed)
    model = MoELM(recipe=recipe, seq=args.seq).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed + 1)
    losses, start = [], time.time()
    n_train = int(len(data) * 0.95)
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / 30) * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        ix = torch.randint(0, n_train - args.seq - 1, (args.batch,), generator=gen)
        chunk = torch.stack([data[i: i + args.seq + 1] for i in ix]).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            logits, aux = model(chunk[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, 256), chunk[:, 1:].reshape(-1))
        (loss + 0.01 * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # logging only, outside the MoE op path
        if step % 50 == 0 or step == args.steps - 1:
            print(f"{recipe:14s} step {step:4d} loss {losses[-1]:.4f} ({time.time() - start:.0f} s)", flush=True)
    # held-out loss
    model.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
        ev = []
        for i in range(8):  # 8 held-out batches of consecutive windows after the training region
            j = n_train + i * (args.seq + 1) * args.batch
            chunk = torch.stack([data[j + b * (args.seq + 1): j + (b + 1) * (args.seq + 1)]
                                 for b in range(args.batch)]).to(device)
            logits, _ = model(chunk[:, :-1])
            ev.append(F.cross_entropy(logits.float().reshape(-1, 256), chunk[:, 1:].reshape(-1)).item())
    return {"losses": losses, "eval_loss": sum(ev) / len(ev), "seconds": time.time() - start}


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for recipe, r in results["runs"].items():
        ls = r["losses"]
        smooth = [sum(ls[max(0, i - 9): i + 1]) / len(ls[max(0, i - 9): i + 1]) for i in range(len(ls))]
        ax.plot(smooth, label=f"{recipe} (eval {r['eval_loss']:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (10-step mean), nats/byte")
    ax.set_title(f"MoE char LM on Python stdlib source, {results['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(prog="python -m bench.examples.train_lm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help=f"output folder of lm_loss.json and .png ({describe('train_lm')})")
    ap.add_argument("--plot", default=None, help="only plot an existing results JSON (the PNG goes to the output folder)")
    args = ap.parse_args()
    if args.plot:
        require_module("python -m bench.examples.train_lm --plot", "matplotlib")
        with open(args.plot) as f:
            results = json.load(f)
        plot(results, str(out_dir(args.out, "train_lm") / (os.path.splitext(os.path.basename(args.plot))[0] + ".png")))
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    data = load_corpus(8 << 20)
    print(f"corpus: {len(data) / 1e6:.1f} MB of Python stdlib source")
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "args": vars(args), "runs": {}}
    for recipe in ("bf16", "fp8_blockwise"):
        results["runs"][recipe] = train(recipe, data, args, device)
    gap = results["runs"]["fp8_blockwise"]["eval_loss"] - results["runs"]["bf16"]["eval_loss"]
    final = {k: sum(v["losses"][-20:]) / len(v["losses"][-20:]) for k, v in results["runs"].items()}
    results["final_train_loss_last20"] = final
    results["eval_gap_fp8_minus_bf16"] = gap
    print(f"final train loss (mean of last 20 steps): {final}; held-out loss gap fp8 - bf16: {gap:+.4f}")
    out = out_dir(args.out, "train_lm")
    path = str(out / "lm_loss.json")
    with open(path, "w") as f:
        json.dump(results, f)
    print(f"wrote {path}")
    try:
        plot(results, str(out / "lm_loss.png"))
    except ImportError:
        print("matplotlib missing: plot later with --plot", path)


if __name__ == "__main__":
    main()
