"""What a peer module of the suite offers (bench/suite/implementations.py calls it), and what every peer's
expert MLP computes.

For the variants it builds (keys of bench/suite/variants.py; the family before the first "_" names the
module, bench/suite/implementations.py), a peer module offers
    load(key)                            imports what the variant needs; raises, saying why, if it cannot run here
    fc1(key, case) -> callable           fc1's forward (called under no_grad; per-call work inside, timed)
    mlp(key, case) -> MLPImpl            the expert MLP, forward and backward
where ``case`` holds one benchmark point's inputs (bench/suite/cases.py: x, W1, W2, m, probs, dy, their
gradient leaves xg, pg, W1g, W2g, and E, H, F, T, kind)."""

from __future__ import annotations

import torch
import torch.nn.functional as F_


class MLPImpl:
    """fwd(x, m, probs) -> y; params: the weight leaves; to_w(grads of params) -> (dW1, dW2) stacked."""

    def __init__(self, fwd, params, to_w=None):
        self.fwd, self.params = fwd, params
        self.to_w = to_w or (lambda g: (g[0], g[1]))


def swiglu_probs(h, probs, F):
    """The expert activation of every peer: silu(gate) * up * probs (torch ops, in h's dtype)."""
    return F_.silu(h[:, :F]) * h[:, F:] * probs.to(h.dtype).unsqueeze(-1)


def offsets(m):
    """Cumulative int32 group ends of device m_splits (the ``offs`` of torch's grouped GEMMs)."""
    return torch.cumsum(m, 0, dtype=torch.int32)
