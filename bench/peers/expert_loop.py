"""The per-expert loop as a peer (Megatron's SequentialMLP / TE-legacy pattern): ``torch.split`` of the
tokens by ``m_splits.tolist()`` (a host sync) and one ``F.linear`` per expert with per-expert weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F_

from bench.peers.interface import MLPImpl, swiglu_probs



def load(key):
    pass  # plain torch


def fc1(key, c):
    x, m = c.x, c.m
    w1s = [c.W1[e].clone() for e in range(c.E)]
    return lambda: torch.cat([F_.linear(xe, w) for xe, w in zip(x.split(m.tolist()), w1s)])


def mlp(key, c):
    E, F = c.E, c.F
    w1s = [c.W1[e].clone().requires_grad_() for e in range(E)]
    w2s = [c.W2[e].clone().requires_grad_() for e in range(E)]

    def fwd(x, m, p):
        splits = m.tolist()
        return torch.cat([F_.linear(swiglu_probs(F_.linear(xe, w1), pe, F), w2)
                          for xe, pe, w1, w2 in zip(x.split(splits), p.split(splits), w1s, w2s)])
    return MLPImpl(fwd, w1s + w2s, lambda g: (torch.stack(g[:E]), torch.stack(g[E:])))
