"""FP8 against bf16 experts at real width: a DeepSeek-V2-Lite-shaped MoE LM, thousands of steps.

A decoder-only byte-level LM (vocab 256) on the Python standard library's own source (every ``*.py``
under ``sysconfig.get_paths()['stdlib']``, site-packages excluded; every 20th file, in sorted order, is the
fixed held-out split): embedding -> L x [RMSNorm, causal attention (``F.scaled_dot_product_attention``,
rotary position embeddings on q and k; ``--qk-norm`` optional), RMSNorm, MoE] -> RMSNorm -> head, pre-norm
throughout; normal(0, 0.02) init with the residual projections (attention out, experts' fc2) at
0.02 / sqrt(2 layers). (``--pos learned --no-resid-scale --lr 5e-4 --warmup 100 --batch 4 --eval-every 200
--eval-batches 8 --recipes bf16,fp8_blockwise`` is the earlier setup, learned absolute positions: its runs sat
on a loss plateau at ~2.35 nats/byte and left it at a step that varied by hundreds from run to run.)
The MoE is DeepSeek-V2-Lite's routed-expert shape: 64 experts of ffn 1408 on hidden 2048, top-6 softmax router in fp32 (top-k probs
renormalised), tokens sorted by expert on the device (``argsort``), ``m_splits = bincount(...)`` as a
device tensor that is never read on the host, ``moegemm.GroupedMLP`` experts (SwiGLU, router probs
applied inside), un-permute and sum of the k outputs. No capacity limit: no token is dropped. A
Switch/DeepSeek load-balancing loss ``E * sum_e f_e P_e`` per layer is added with a small coefficient.

The same model is trained with experts in ``fp8_blockwise`` and in ``bf16`` from the same seed,
initial weights (checked by a fingerprint) and batches; everything else runs in bf16 autocast with fp32
master weights. AdamW, linear warm-up and cosine decay, gradient clipping at 1.0, gradient
accumulation over ``--micro`` micro-batches; with FP8 the first micro-batch of each optimizer step passes
``is_first_microbatch=True`` (quantize the expert weights once and keep the FP8 copies) and the others
``False``; with bf16 ``None``. A third run, ``bf16_again``, repeats the bf16 run with nothing changed: on
the GPU it differs from it only by nondeterministic kernels (on the CPU the two are bitwise identical), so
its gap to the bf16 run is the run-to-run noise that FP8's gap is read against (``bf16_data2``: the bf16
run on another data order instead).

Recorded per run: train loss every step, held-out loss every ``--eval-every`` steps and at the end (a
fixed set of held-out batches), tokens/s over the timed steps (synchronised wall-clock, the first
``--warmup-timing`` steps and the evaluations excluded), peak memory, gradient norm, and the router's load
balance per logging interval (max/mean tokens per expert, coefficient of variation, experts left empty)
together with the RMS of the MoE's output relative to the residual stream it is added to (the experts
carry signal). The
comparison (final held-out relative gap, max relative gap of the smoothed train-loss curves after the
first 10 % of steps), for FP8 against bf16 and for the control against bf16, is computed here and stored
in the JSON, which is rewritten after every evaluation (a run cut off by a timeout leaves its curves).

    python -m bench.examples.train_moe_lm              # the full run (one H200: bf16, fp8_blockwise, bf16_again)
    python -m bench.examples.train_moe_lm --plot-only bench/results/train_moe_lm.json   # PNG from the JSON
    python -m bench.examples.train_moe_lm --tiny       # CPU smoke configuration (reference backend)

The JSON (and the PNG beside it) go to --out, by default ~/.cache/moegemm-bench/train_moe_lm/train_moe_lm.json
(outside the repository); ``--out bench/results/train_moe_lm.json`` rewrites the committed results.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F
from torch import nn

import moegemm
from bench.outputs import describe, out_file
from bench.preflight import require_module

RECIPES = ("bf16", "fp8_blockwise")
# Diagnostic variants (same parameters, init and batches; the experts' math differs), for --recipes:
#   fp8_fc1_only / fp8_fc2_only / bf16_composed: the MLP as two grouped_linear calls (fc1 recipe, fc2 recipe)
#     with the SwiGLU x probs in plain PyTorch between them; only the named GEMM (fprop, dgrad, wgrad) in FP8.
#   fp8_fwd_only: forward values of the fp8_blockwise MLP, gradients of the bf16 one (straight-through).
COMPOSED = {"fp8_fc1_only": ("fp8_blockwise", "bf16"), "fp8_fc2_only": ("bf16", "fp8_blockwise"),
            "bf16_composed": ("bf16", "bf16")}
# Noise controls: bf16 experts again, for the run-to-run spread that FP8's gap is read against.
#   bf16_again: the bf16 run repeated with nothing changed (same seed, initial weights, batches, schedule,
#     process): on the GPU it differs from the first only by nondeterministic kernels (atomic additions in
#     the gather's backward, etc.); on the CPU the two are bitwise identical.
#   bf16_data2: the bf16 run with another data-order seed (other batches; same initial weights).
CONTROLS = {"bf16_again": ("bf16", 0), "bf16_data2": ("bf16", 1000)}
VARIANTS = RECIPES + tuple(COMPOSED) + ("fp8_fwd_only",) + tuple(CONTROLS)


# ----------------------------------------------------------------------------------------------- data

def load_corpus(max_bytes: int = 0):
    """(train bytes, held-out bytes, info): every *.py of the stdlib in sorted order; file i with
    i % 20 == 19 goes to the held-out split."""
    root = sysconfig.get_paths()["stdlib"]
    paths = sorted(p for p in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                   if "site-packages" not in p and "dist-packages" not in p)
    train, held = bytearray(), bytearray()
    for i, path in enumerate(paths):
        with open(path, "rb") as f:
            (held if i % 20 == 19 else train).extend(f.read())
        if max_bytes and len(train) + len(held) >= max_bytes:
            break
    digest = hashlib.sha256(bytes(train) + b"\0" + bytes(held)).hexdigest()[:16]
    info = {"root": root, "python": sys.version.split()[0], "files": len(paths), "train_bytes": len(train),
            "heldout_bytes": len(held), "sha256_16": digest}
    as_t = lambda b: torch.frombuffer(b, dtype=torch.uint8).clone()  # noqa: E731  (a bytearray: writable)
    return as_t(train), as_t(held), info


# ---------------------------------------------------------------------------------------------- model

class MoE(nn.Module):
    def __init__(self, d, ffn, experts, top_k, recipe):
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = moegemm.GroupedMLP(experts, d, ffn, activation="swiglu", bias=False,
                                          recipe=recipe if recipe in RECIPES else "bf16", dtype=torch.float32)
        self.E, self.top_k, self.variant = experts, top_k, recipe

    def expert_mlp(self, xs, m_splits, ps, is_first_microbatch):
        if self.variant in RECIPES:
            return self.experts(xs, m_splits, ps, is_first_microbatch=is_first_microbatch)
        w1, w2 = self.experts.fc1.weight, self.experts.fc2.weight
        if self.variant == "fp8_fwd_only":
            y = moegemm.grouped_mlp(xs, w1, w2, m_splits, ps, activation="swiglu", recipe="bf16")
            with torch.no_grad():
                y8 = moegemm.grouped_mlp(xs, w1, w2, m_splits, ps, activation="swiglu", recipe="fp8_blockwise")
            return y + (y8 - y).detach()
        r1, r2 = COMPOSED[self.variant]
        h = moegemm.grouped_linear(xs, w1, m_splits, recipe=r1).float()
        gate, up = h.chunk(2, dim=-1)  # Megatron's GLU layout, gate first (as GroupedMLP)
        a = (F.silu(gate) * up * ps.float()[:, None]).to(xs.dtype)
        return moegemm.grouped_linear(a, w2, m_splits, recipe=r2)

    def forward(self, x, is_first_microbatch):  # x [T, d]
        T, k, E = x.shape[0], self.top_k, self.E
        with torch.autocast(x.device.type, enabled=False):  # the router in fp32
            probs_all = F.linear(x.float(), self.router.weight.float()).softmax(-1)  # [T, E]
        probs, eid = probs_all.topk(k, dim=-1)  # [T, k]
        probs = probs / probs.sum(-1, keepdim=True)
        flat_e = eid.reshape(-1)  # slot i = token i // k
        order = torch.argsort(flat_e, stable=True)  # slots sorted by expert, on the device
        token = order // k
        m_splits = torch.bincount(flat_e, minlength=E)  # device tensor, never read on the host
        y = self.expert_mlp(x[token].to(torch.bfloat16), m_splits, probs.reshape(-1)[order],
                            is_first_microbatch)  # [T*k, d], probs applied inside
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=x.device)
        out = y[inv].view(T, k, -1).sum(1).to(x.dtype)  # back to token order, sum of the k experts
        # Switch / DeepSeek load-balancing loss: E * sum_e f_e P_e (1 when balanced)
        f = m_splits.float() / flat_e.numel()
        aux = E * (f * probs_all.mean(0)).sum()
        return out, aux, m_splits


def rope_tables(seq, dim, base=10000.0):
    """cos, sin [seq, dim // 2] (fp32) of rotary position embeddings (GPT-NeoX half-split layout)."""
    inv = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ang = torch.arange(seq, dtype=torch.float64)[:, None] * inv[None, :]
    return ang.cos().float(), ang.sin().float()


def apply_rope(x, cos, sin):  # x [..., S, D]; cos, sin [S, D/2]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Block(nn.Module):
    def __init__(self, d, heads, ffn, experts, top_k, recipe, stats, a):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(d, eps=1e-5), nn.RMSNorm(d, eps=1e-5)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.moe = MoE(d, ffn, experts, top_k, recipe)
        self.heads, self.stats = heads, stats
        hd = d // heads
        self.qk_norm = a.qk_norm
        if a.qk_norm:  # RMSNorm of q and k over the head dimension, before the rotation
            self.qn, self.kn = nn.RMSNorm(hd, eps=1e-5), nn.RMSNorm(hd, eps=1e-5)
        self.rope = a.pos == "rope"
        if self.rope:
            cos, sin = rope_tables(a.seq, hd)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)

    def forward(self, x, is_first_microbatch):  # [B, S, d]
        B, S, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(B, S, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.qk_norm:
            q, k = self.qn(q).to(v.dtype), self.kn(k).to(v.dtype)
        if self.rope:
            q, k = apply_rope(q, self.cos[:S], self.sin[:S]), apply_rope(k, self.cos[:S], self.sin[:S])
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, d)
        x = x + self.proj(att)
        y, aux, m_splits = self.moe(self.n2(x).reshape(B * S, d), is_first_microbatch)
        if self.stats is not None:  # on the device, read once per logging interval
            with torch.no_grad():
                c = m_splits.float()
                mean = c.mean()
                self.stats.append(torch.stack([c.max() / mean, c.std(unbiased=False) / mean, (c == 0).float().sum(),
                                               y.float().pow(2).mean().sqrt() / x.float().pow(2).mean().sqrt()]))
        return x + y.view(B, S, d), aux


class MoELM(nn.Module):
    def __init__(self, a, recipe, stats=None):
        super().__init__()
        d = a.hidden
        self.emb = nn.Embedding(256, d)
        self.pos = nn.Parameter(torch.empty(a.seq, d)) if a.pos == "learned" else None
        self.blocks = nn.ModuleList(Block(d, a.heads or max(1, d // 128), a.ffn, a.experts, a.top_k, recipe, stats, a)
                                    for _ in range(a.layers))
        self.norm, self.head = nn.RMSNorm(d, eps=1e-5), nn.Linear(d, 256, bias=False)
        with torch.no_grad():  # normal(0, init_std) everywhere, the experts included; norms at 1
            for name, p in self.named_parameters():
                if p.dim() >= 2:
                    std = a.init_std
                    # the projections that write into the residual stream (attention out, experts' fc2)
                    if a.resid_scale and (name.endswith(".proj.weight") or name.endswith(".fc2.weight")):
                        std = a.init_std / math.sqrt(2 * a.layers)
                    p.normal_(0.0, std)

    def forward(self, idx, is_first_microbatch=None):
        x = self.emb(idx)
        if self.pos is not None:
            x = x + self.pos[: idx.shape[1]]
        aux = 0.0
        for blk in self.blocks:
            x, a = blk(x, is_first_microbatch)
            aux = aux + a
        return self.head(self.norm(x)), aux


def fingerprint(model) -> float:
    with torch.no_grad():
        return float(sum((p.double() * (i + 1)).sum() for i, p in enumerate(model.parameters())))


# ------------------------------------------------------------------------------------------- training

def lr_at(step, a):
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    t = (step - a.warmup) / max(1, a.steps - a.warmup)
    return a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def train(recipe, train_data, held_data, a, device, save=None):
    """One run; ``save(partial_result)`` is called after every evaluation (a run cut off by a timeout
    leaves its curves up to there)."""
    model_recipe, data_offset = CONTROLS.get(recipe, (recipe, 0))
    torch.manual_seed(a.seed)
    stats: list = []
    model = MoELM(a, model_recipe, stats).to(device)
    fp = fingerprint(model)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    cuda = device.type == "cuda"
    amp = torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda)

    # The same batches for both runs: every offset of the run drawn up front from a seeded generator
    # and moved to the device once (no host->device copy, hence no sync, in the loop).
    gen = torch.Generator().manual_seed(a.seed + 1 + data_offset)
    offs = torch.randint(0, len(train_data) - a.seq - 1, (a.steps, a.micro, a.batch), generator=gen).to(device)
    data = train_data.to(device)
    ar = torch.arange(a.seq + 1, device=device)
    # fixed held-out set: n_eval batches of windows spread evenly over the held-out split
    n_win = a.eval_batches * a.batch
    starts = torch.linspace(0, len(held_data) - a.seq - 2, n_win).long()
    held = torch.stack([held_data[s: s + a.seq + 1] for s in starts.tolist()]).long().view(
        a.eval_batches, a.batch, a.seq + 1).to(device)

    def evaluate():
        model.eval()
        n0 = len(stats)
        with torch.no_grad(), amp:
            tot = torch.zeros((), device=device)
            for b in range(a.eval_batches):
                logits, _ = model(held[b, :, :-1], None)
                tot += F.cross_entropy(logits.float().reshape(-1, 256), held[b, :, 1:].reshape(-1))
        del stats[n0:]
        model.train()
        return (tot / a.eval_batches).item()

    n_tok_step = a.micro * a.batch * a.seq
    loss_buf = torch.zeros(a.steps, device=device)
    aux_buf = torch.zeros(a.steps, device=device)
    gnorm_buf = torch.zeros(a.steps, device=device)
    evals, intervals = [], []
    timed_s, t_start = 0.0, time.perf_counter()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    seg = time.perf_counter()
    n_steps = min(a.steps, a.stop_at or a.steps)  # --stop-at: fewer steps on the same schedule

    def snapshot(done, timed_s):
        timed_steps = done - a.warmup_timing
        return {
            "recipe": recipe,
            "experts_recipe": model_recipe,
            "data_seed": a.seed + 1 + data_offset,
            "complete": done == n_steps,
            "steps_done": done,
            "init_fingerprint": fp,
            "train_loss": loss_buf[:done].tolist(),
            "aux_loss": aux_buf[:done].tolist(),
            "grad_norm": gnorm_buf[:done].tolist(),
            "heldout": list(evals),
            "final_heldout_loss": evals[-1]["loss"],
            "intervals": list(intervals),
            "timed_steps": timed_steps,
            "timed_seconds": timed_s,
            "tokens_per_s": timed_steps * n_tok_step / timed_s if timed_s > 0 and timed_steps > 0 else None,
            "ms_per_step": 1e3 * timed_s / timed_steps if timed_s > 0 and timed_steps > 0 else None,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "wall_seconds": time.perf_counter() - t_start,
            "params": sum(p.numel() for p in model.parameters()),
            "expert_params": sum(p.numel() for n, p in model.named_parameters() if ".experts." in n),
        }

    for step in range(n_steps):
        lr = lr_at(step, a)
        for g in opt.param_groups:
            g["lr"] = lr
        for mb in range(a.micro):
            chunk = data[(offs[step, mb][:, None] + ar)].long()  # [B, S+1] gathered on the device
            first = (mb == 0) if model_recipe == "fp8_blockwise" else None  # FP8 weights once per optimizer step
            with amp:
                logits, aux = model(chunk[:, :-1], first)
                loss = F.cross_entropy(logits.float().reshape(-1, 256), chunk[:, 1:].reshape(-1))
            ((loss + a.aux_coef * aux) / a.micro).backward()
            loss_buf[step] += loss.detach() / a.micro
            aux_buf[step] += aux.detach() / (a.micro * a.layers)
        gnorm_buf[step] = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        last = step == n_steps - 1
        log = (step + 1) % a.log_every == 0 or last
        if step == a.warmup_timing - 1 or log:
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            if step >= a.warmup_timing:
                timed_s += now - seg
            if log:
                st = torch.stack(stats).view(-1, a.layers, 4).mean(0).cpu()  # per layer, averaged over the interval
                stats.clear()
                lo = step + 1 - ((step + 1) % a.log_every or a.log_every)
                rec = {"step": step + 1, "train_loss": loss_buf[lo: step + 1].mean().item(), "lr": lr,
                       "aux": aux_buf[lo: step + 1].mean().item(),
                       "max_over_mean": st[:, 0].tolist(), "cv": st[:, 1].tolist(), "empty_experts": st[:, 2].tolist(),
                       "moe_rms_ratio": st[:, 3].tolist()}
                intervals.append(rec)
                msg = (f"{recipe:14s} step {step + 1:5d} loss {rec['train_loss']:.4f} aux {rec['aux']:.3f} "
                       f"max/mean {sum(rec['max_over_mean']) / a.layers:.2f} cv {sum(rec['cv']) / a.layers:.3f} "
                       f"gnorm {gnorm_buf[step].item():.3f} lr {lr:.2e} ({time.perf_counter() - t_start:.0f} s)")
                if (step + 1) % a.eval_every == 0 or last:
                    ev = evaluate()
                    evals.append({"step": step + 1, "loss": ev})
                    msg += f" held-out {ev:.4f}"
                print(msg, flush=True)
                if save is not None and evals and evals[-1]["step"] == step + 1 and not last:
                    save(snapshot(step + 1, timed_s))
            if cuda:
                torch.cuda.synchronize()
            seg = time.perf_counter()
    res = snapshot(n_steps, timed_s)
    del model, opt, data
    if cuda:
        torch.cuda.empty_cache()
    return res


# ------------------------------------------------------------------------------------------ comparison

def smooth(xs, w):
    out, s = [], 0.0
    for i, x in enumerate(xs):
        s += x - (xs[i - w] if i >= w else 0.0)
        out.append(s / min(i + 1, w))
    return out


def pair_gap(x, ref, w, steps):
    """Run ``x`` against run ``ref`` over their common steps: relative gap (x - ref) / ref of the
    ``w``-step moving means of the train loss (max |gap| and mean after the first 10 % of the schedule's
    ``steps``) and of the held-out loss at their common evaluations (the last common one is "final")."""
    n = min(len(x["train_loss"]), len(ref["train_loss"]))
    sx, sr = smooth(x["train_loss"][:n], w), smooth(ref["train_loss"][:n], w)
    rel = [(u - v) / v for u, v in zip(sx, sr)]
    start = steps // 10
    after = rel[start:] or [0.0]
    i_max = max(range(len(after)), key=lambda i: abs(after[i]))
    ev = {e["step"]: e["loss"] for e in ref["heldout"]}
    held = [{"step": e["step"], "rel_gap": (e["loss"] - ev[e["step"]]) / ev[e["step"]]} for e in x["heldout"]
            if e["step"] in ev]
    return {
        "common_steps": n,
        "both_complete": x.get("complete", True) and ref.get("complete", True),
        "final_heldout": x["heldout"][-1]["loss"] if held else None,
        "final_heldout_ref": ev[held[-1]["step"]] if held else None,
        "final_heldout_step": held[-1]["step"] if held else None,
        "final_heldout_rel_gap": held[-1]["rel_gap"] if held else None,
        "heldout_rel_gap_by_eval": held,
        "train_curve_max_abs_rel_gap_after_10pct": abs(after[i_max]),
        "train_curve_max_gap_step": start + i_max + 1,
        "train_curve_mean_rel_gap_after_10pct": sum(after) / len(after),
        "train_curve_rel_gap_every_100": {str(k): rel[k - 1] for k in range(100, n + 1, 100)},
    }


def compare(results):
    runs = results["runs"]
    if not all(r in runs for r in RECIPES):
        return None
    b, f = runs["bf16"], runs["fp8_blockwise"]
    w, steps = results["args"]["smooth"], results["args"]["steps"]
    fb = pair_gap(f, b, w, steps)
    c = {
        "smooth_window": w,
        "final_heldout_step": fb["final_heldout_step"],  # the last evaluation both runs reached
        "final_heldout_bf16": fb["final_heldout_ref"],
        "final_heldout_fp8": fb["final_heldout"],
        "final_heldout_rel_gap": fb["final_heldout_rel_gap"],
        "heldout_rel_gap_by_eval": fb["heldout_rel_gap_by_eval"],
        "train_curve_max_abs_rel_gap_after_10pct": fb["train_curve_max_abs_rel_gap_after_10pct"],
        "train_curve_max_gap_step": fb["train_curve_max_gap_step"],
        "train_curve_mean_rel_gap_after_10pct": fb["train_curve_mean_rel_gap_after_10pct"],
        "same_initial_weights": b["init_fingerprint"] == f["init_fingerprint"],
        "tokens_per_s_bf16": b["tokens_per_s"],
        "tokens_per_s_fp8": f["tokens_per_s"],
        "speedup_fp8_over_bf16": (f["tokens_per_s"] / b["tokens_per_s"]) if b["tokens_per_s"] and f["tokens_per_s"] else None,
        "peak_memory_gib_bf16": b["peak_memory_gib"],
        "peak_memory_gib_fp8": f["peak_memory_gib"],
        "both_complete": fb["both_complete"],
    }
    c["accept_heldout_within_0.5pct"] = abs(c["final_heldout_rel_gap"]) <= 0.005
    c["accept_curves_within_1pct"] = c["train_curve_max_abs_rel_gap_after_10pct"] <= 0.01
    # the noise control: the same gaps between two bf16 runs, and FP8 against the second bf16 run
    pairs = {"fp8_blockwise_vs_bf16": fb}
    for ctl in CONTROLS:
        if ctl in runs:
            pairs[f"{ctl}_vs_bf16"] = pair_gap(runs[ctl], b, w, steps)
            pairs[f"fp8_blockwise_vs_{ctl}"] = pair_gap(f, runs[ctl], w, steps)
            c.setdefault("noise_control", ctl)
    c["pairs"] = pairs
    ctl = c.get("noise_control")
    if ctl:
        cb = pairs[f"{ctl}_vs_bf16"]
        c["control_final_heldout_rel_gap"] = cb["final_heldout_rel_gap"]
        c["control_final_heldout_step"] = cb["final_heldout_step"]
        c["control_train_curve_max_abs_rel_gap_after_10pct"] = cb["train_curve_max_abs_rel_gap_after_10pct"]
        c["control_complete"] = cb["both_complete"]
        c["fp8_heldout_gap_within_control_gap"] = (abs(c["final_heldout_rel_gap"])
                                                   <= abs(cb["final_heldout_rel_gap"] or 0.0))
    return c


def print_summary(results):
    c = results.get("comparison")
    if not c:
        return
    print("\n=== comparison fp8_blockwise vs bf16 ===")
    for k, v in c.items():
        if k not in ("heldout_rel_gap_by_eval", "pairs"):
            print(f"  {k}: {v}")
    print("=== pairs (x vs ref: relative gap of x to ref) ===")
    for name, g in c.get("pairs", {}).items():
        at = " ".join(f"{k}:{100 * v:+.2f}%" for k, v in g["train_curve_rel_gap_every_100"].items())
        fh = g["final_heldout_rel_gap"]
        print(f"  {name}: held-out at step {g['final_heldout_step']} {100 * fh if fh is not None else float('nan'):+.3f} %, "
              f"train curve max |gap| after 10 % {100 * g['train_curve_max_abs_rel_gap_after_10pct']:.3f} % "
              f"(step {g['train_curve_max_gap_step']}), mean {100 * g['train_curve_mean_rel_gap_after_10pct']:+.3f} %, "
              f"{g['common_steps']} common steps{'' if g['both_complete'] else ' (a run incomplete)'}")
        print(f"    train gap every 100 steps: {at}")
        print(f"    held-out gap by eval: " + " ".join(f"{e['step']}:{100 * e['rel_gap']:+.3f}%"
                                                      for e in g["heldout_rel_gap_by_eval"]))
    for r, run in results["runs"].items():
        last = run["intervals"][-1]
        lb = [sum(x["max_over_mean"]) / len(x["max_over_mean"]) for x in run["intervals"]]
        cv = [sum(x["cv"]) / len(x["cv"]) for x in run["intervals"]]
        print(f"  {r}: load balance max/mean first {lb[0]:.2f} last {lb[-1]:.2f} (per layer {last['max_over_mean']}), "
              f"cv first {cv[0]:.3f} last {cv[-1]:.3f}, moe rms ratio {last['moe_rms_ratio']}")


COLORS = {"bf16": "tab:blue", "fp8_blockwise": "tab:red", "bf16_again": "tab:green", "bf16_data2": "tab:green"}


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, a = results["runs"], results["args"]
    w = a["smooth"]
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.2))
    ax = axes[0]
    for r, run in runs.items():
        tag = "" if run.get("complete", True) else f", cut at {run['steps_done']}"
        ax.plot(range(1, len(run["train_loss"]) + 1), smooth(run["train_loss"], w), color=COLORS.get(r), lw=1.0,
                ls="-" if r in RECIPES else ":", label=f"{r} train ({w}-step mean)")
        ax.plot([e["step"] for e in run["heldout"]], [e["loss"] for e in run["heldout"]], "o--", color=COLORS.get(r),
                ms=3.5, lw=0.7, mfc="none" if r not in RECIPES else None,
                label=f"{r} held-out (last {run['heldout'][-1]['loss']:.4f}{tag})")
    ax.set_ylim(top=min(3.0, ax.get_ylim()[1]))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss, nats/byte")
    ax.set_title("loss")
    ax.legend(fontsize=7.5)
    c = results.get("comparison")
    ax = axes[1]
    if c:
        n_all = len(runs["bf16"]["train_loss"])
        lim = 1.5
        pair_style = {"fp8_blockwise_vs_bf16": ("tab:purple", "fp8_blockwise vs bf16")}
        for ctl in CONTROLS:
            pair_style[f"{ctl}_vs_bf16"] = ("tab:green", f"{ctl} vs bf16 (noise control)")
        for name, (col, label) in pair_style.items():
            g = c.get("pairs", {}).get(name)
            if g is None:
                continue
            x, ref = name.split("_vs_")
            sx = smooth(runs[x]["train_loss"][: g["common_steps"]], w)
            sr = smooth(runs[ref]["train_loss"][: g["common_steps"]], w)
            ax.plot(range(1, len(sx) + 1), [100 * (u - v) / v for u, v in zip(sx, sr)], color=col, lw=0.9,
                    label=f"{label}: train ({w}-step mean), max after 10 % "
                          f"{100 * g['train_curve_max_abs_rel_gap_after_10pct']:.2f} %")
            fh = g["final_heldout_rel_gap"]
            ax.plot([e["step"] for e in g["heldout_rel_gap_by_eval"]], [100 * e["rel_gap"] for e in g["heldout_rel_gap_by_eval"]],
                    "o-", color=col, ms=4, lw=1.6, alpha=0.8,
                    label=f"{label}: held-out, final {100 * fh:+.2f} %" if fh is not None else label)
            lim = max(lim, 110 * g["train_curve_max_abs_rel_gap_after_10pct"],
                      *(110 * abs(e["rel_gap"]) for e in g["heldout_rel_gap_by_eval"]))
        ax.axvline(n_all // 10, color="gray", ls=":", lw=0.8)
        for y in (-1, 1):
            ax.axhline(y, color="gray", ls="--", lw=0.8)
        for y in (-0.5, 0.5):
            ax.axhline(y, color="gray", ls=":", lw=0.6)
        ax.axhline(0, color="k", lw=0.5)
        ax.set_ylim(-lim, lim)
        ax.legend(fontsize=7.5)
        ax.set_title("relative gap (x - bf16) / bf16; dashed: 1 % curve bound, dotted: 0.5 % held-out bound",
                     fontsize=9)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("relative gap, %")
    ax = axes[2]
    for r, run in runs.items():
        st = [x["step"] for x in run["intervals"]]
        ax.plot(st, [sum(x["max_over_mean"]) / len(x["max_over_mean"]) for x in run["intervals"]], color=COLORS.get(r),
                ls="-" if r in RECIPES else ":", label=f"{r} max/mean tokens per expert")
        ax.plot(st, [1 + sum(x["cv"]) / len(x["cv"]) for x in run["intervals"]], color=COLORS.get(r), ls="--",
                label=f"{r} 1 + coeff. of variation")
    ax.set_xlabel("optimizer step")
    ax.set_title("router load balance (mean over layers)")
    ax.legend(fontsize=7.5)
    tps = ", ".join(f"{r} {run['tokens_per_s'] / 1e3:.0f}k tok/s" for r, run in runs.items() if run.get("tokens_per_s"))
    pos = a.get("pos", "learned")
    fig.suptitle(f"MoE byte LM, {a['layers']} layers, hidden {a['hidden']}, {a['experts']} experts x ffn {a['ffn']} "
                 f"top-{a['top_k']}, seq {a['seq']} ({pos} positions), {a['steps']} steps x {a['micro']}x{a['batch']} seqs, "
                 f"lr {a['lr']:g} (warm-up {a['warmup']}); {results['device']}; {tps}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def versus_reference(results, ref):
    """Each run of a diagnostic call against the bf16 and fp8_blockwise curves of the reference run (the
    full comparison), over their common steps: relative gap of the smoothed train loss and of the
    held-out loss at the common evaluations."""
    w = results["args"]["smooth"]
    out = {}
    for name, run in results["runs"].items():
        row = {}
        for rname, rrun in ref["runs"].items():
            n = min(len(run["train_loss"]), len(rrun["train_loss"]))
            s, sr = smooth(run["train_loss"][:n], w), smooth(rrun["train_loss"][:n], w)
            rel = [(x - y) / y for x, y in zip(s, sr)]
            ev = {e["step"]: e["loss"] for e in rrun["heldout"]}
            row[rname] = {
                "steps": n,
                "train_max_abs_rel_gap_after_10pct_of_reference": max(abs(g) for g in rel[len(rrun["train_loss"]) // 10:]),
                "train_rel_gap_at": {str(k): rel[k - 1] for k in range(100, n + 1, 100)},
                "heldout_rel_gap_at": {str(e["step"]): (e["loss"] - ev[e["step"]]) / ev[e["step"]]
                                       for e in run["heldout"] if e["step"] in ev},
            }
        out[name] = row
    return out


def plot_variants(results, ref, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = results["args"]["smooth"]
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.8))
    for name, run in ref["runs"].items():
        n = len(run["train_loss"])
        m = max(len(r["train_loss"]) for r in results["runs"].values())
        axes[0].plot(range(1, min(n, m) + 1), smooth(run["train_loss"], w)[:m], lw=2.5, alpha=0.35,
                     color={"bf16": "tab:blue", "fp8_blockwise": "tab:red"}.get(name), label=f"{name} (full comparison run)")
    base = smooth(ref["runs"]["bf16"]["train_loss"], w)
    for name, run in results["runs"].items():
        s = smooth(run["train_loss"], w)
        axes[0].plot(range(1, len(s) + 1), s, lw=1, label=name)
        axes[1].plot(range(1, len(s) + 1), [100 * (x - y) / y for x, y in zip(s, base)], lw=1, label=name)
    f8 = smooth(ref["runs"]["fp8_blockwise"]["train_loss"], w)[: len(s)]
    axes[1].plot(range(1, len(f8) + 1), [100 * (x - y) / y for x, y in zip(f8, base)], lw=2.5, alpha=0.35,
                 color="tab:red", label="fp8_blockwise (full comparison run)")
    axes[0].set_ylim(top=3.0)
    axes[0].set_ylabel(f"train loss ({w}-step mean), nats/byte")
    axes[0].legend(fontsize=8)
    axes[1].axhline(0, color="gray", lw=0.8)
    axes[1].set_ylabel("% relative to the full run's bf16 curve")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.set_xlabel("optimizer step")
    fig.suptitle("Diagnostic runs: the same initial weights and batches, the same schedule; only the experts' numerics "
                 f"differ ({results['device']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


# ------------------------------------------------------------------------------------------------ main

def main():
    ap = argparse.ArgumentParser(prog="python -m bench.examples.train_moe_lm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=0, help="0: hidden // 128")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=1408)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=3, help="sequences per micro-batch")
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per optimizer step")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--stop-at", type=int, default=0, help="stop after this many steps (schedule of --steps)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--init-std", type=float, default=0.02)
    ap.add_argument("--resid-scale", action=argparse.BooleanOptionalAction, default=True,
                    help="init std of the residual projections (attention out, experts' fc2) / sqrt(2 layers)")
    ap.add_argument("--pos", choices=("rope", "learned"), default="rope",
                    help="rotary position embeddings in attention, or learned absolute ones added to the input")
    ap.add_argument("--qk-norm", action=argparse.BooleanOptionalAction, default=False,
                    help="RMSNorm of q and k per head")
    ap.add_argument("--aux-coef", type=float, default=1e-2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--warmup-timing", type=int, default=20, help="steps left out of tokens/s")
    ap.add_argument("--smooth", type=int, default=50, help="moving-average window of the train-loss comparison")
    ap.add_argument("--recipes", default=",".join(RECIPES + ("bf16_again",)), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--reference", default=None, help="results JSON of the full comparison, for diagnostic runs")
    ap.add_argument("--max-corpus-bytes", type=int, default=0)
    ap.add_argument("--out", default=None, help=f"the results JSON; its PNG goes beside it ({describe('train_moe_lm')})")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke configuration")
    ap.add_argument("--plot-only", nargs="+", metavar="JSON",
                    help="plot existing results (several JSON files of single runs are merged into --out)")
    a = ap.parse_args()
    if a.plot_only:
        require_module("python -m bench.examples.train_moe_lm --plot-only", "matplotlib")
        results = None
        for p in a.plot_only:
            with open(p) as f:
                r = json.load(f)
            if results is None:
                results = r
            else:
                results["runs"].update(r["runs"])
        results["comparison"] = compare(results)
        # the merged JSON and the PNG: --out, else outside the repository (the PNG named after the one JSON)
        out = out_file(a.out, "train_moe_lm",
                       "train_moe_lm.json" if len(a.plot_only) > 1 else os.path.basename(a.plot_only[0]))
        if len(a.plot_only) > 1:
            with open(out, "w") as f:
                json.dump(results, f)
            print(f"wrote {out}")
        print_summary(results)
        png = os.path.splitext(str(out))[0] + ".png"
        if results["args"].get("reference"):
            with open(a.reference or results["args"]["reference"]) as f:
                plot_variants(results, json.load(f), png)
        else:
            plot(results, png)
        return
    if a.tiny:
        a.hidden, a.experts, a.ffn, a.top_k, a.seq, a.batch, a.micro, a.steps = 128, 8, 64, 2, 64, 2, 2, 20
        a.warmup, a.log_every, a.eval_every, a.eval_batches, a.warmup_timing, a.smooth = 4, 5, 10, 2, 2, 5
        a.lr, a.max_corpus_bytes = 3e-3, a.max_corpus_bytes or (2 << 20)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train_data, held_data, corpus = load_corpus(a.max_corpus_bytes)
    print(f"corpus: {corpus}", flush=True)
    tok_step = a.micro * a.batch * a.seq
    print(f"{a.layers} layers, hidden {a.hidden}, {a.experts} experts x ffn {a.ffn}, top-{a.top_k}; "
          f"{tok_step} tokens/step, {a.steps} steps = {a.steps * tok_step / 1e6:.1f} M tokens "
          f"({a.steps * tok_step / len(train_data):.2f} epochs)", flush=True)
    script = ["-m", __spec__.name] if __spec__ else sys.argv[:1]  # run as a module, as the docstring says
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "command": " ".join([os.path.basename(sys.executable)] + script + sys.argv[1:]),
               "args": vars(a), "corpus": corpus, "runs": {}}
    a.out = str(out_file(a.out, "train_moe_lm", "train_moe_lm.json"))
    print(f"results: {a.out}", flush=True)
    ref = None
    if a.reference:
        with open(a.reference) as f:
            ref = json.load(f)
    for recipe in a.recipes.split(","):
        if recipe not in VARIANTS:
            raise SystemExit(f"unknown recipe/variant {recipe!r}; one of {VARIANTS}")
    def save(recipe, run):
        results["runs"][recipe] = run
        results["comparison"] = compare(results)
        if ref is not None:
            results["vs_reference"] = versus_reference(results, ref)
        with open(a.out, "w") as f:  # after each evaluation, so a run cut off by a timeout leaves its curves
            json.dump(results, f)

    for recipe in a.recipes.split(","):
        results["runs"][recipe] = train(recipe, train_data, held_data, a, device,
                                        save=lambda run, recipe=recipe: save(recipe, run))
        r = results["runs"][recipe]
        print(f"{recipe}: final held-out {r['final_heldout_loss']:.4f}, {r['tokens_per_s'] or 0:.0f} tokens/s, "
              f"peak memory {r['peak_memory_gib'] or 0:.2f} GiB, {r['wall_seconds']:.0f} s", flush=True)
        save(recipe, r)
    print_summary(results)
    if ref is not None:
        print("\n=== against the reference run's curves (relative gap of the smoothed train loss) ===")
        for name, row in results["vs_reference"].items():
            for rname, g in row.items():
                at = " ".join(f"{k}:{100 * v:+.1f}%" for k, v in g["train_rel_gap_at"].items())
                print(f"  {name:14s} vs {rname:14s} {at}")
    print(f"wrote {a.out}")
    try:
        if ref is not None:
            plot_variants(results, ref, os.path.splitext(a.out)[0] + ".png")
        else:
            plot(results, os.path.splitext(a.out)[0] + ".png")
    except ImportError:
        print(f"matplotlib missing: python -m bench.examples.train_moe_lm --plot-only {a.out}")


if __name__ == "__main__":
    main()
