"""What every kernel in the local slot takes: (q, k, v, softmax_scale, causal) on (batch, rows, heads, head_dim)."""

from __future__ import annotations

import torch


def softmax_scale(q: torch.Tensor, scale: float | None, causal: bool) -> float:
    """The scale a slot kernel applies (1/sqrt(head_dim) unless given); MiniMax-H3 attention is never causal."""
    if causal:
        raise ValueError("MiniMax-H3 attention is never causal")
    return q.shape[-1] ** -0.5 if scale is None else scale
