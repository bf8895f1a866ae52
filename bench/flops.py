"""Achieved arithmetic rate: the DiT forward's FLOPs counted from the model, and the device's matmul ceiling.

A forward is the block linears over every packed row (the AdaLN projections run on a handful of timestep
rows and are left out) plus self-attention over the whole packed sequence in every block:
2 x (block linear weights) x S + 4 x S^2 x heads x head_dim x blocks. At the released size that is
3.53 PFLOP at 768x1344x124 (S = 37,966) and 0.91 PFLOP at 480x832x124 (S = 15,100).
"""

from __future__ import annotations

import statistics

import torch

from bench.common import timed


def dit_forward_flops(transformer, rows: int) -> float:
    weights = sum(
        module.weight.numel()
        for name, module in transformer.named_modules()
        if isinstance(module, torch.nn.Linear) and name.startswith("transformer_blocks.") and ".adaln_proj." not in name
    )
    config = transformer.config
    attention = 4 * rows * rows * config.num_attention_heads * config.attention_head_dim * config.num_layers
    return 2 * weights * rows + attention


def matmul_ceiling_tflops(device: str, dtype: torch.dtype, n: int = 8192, repeats: int = 5) -> float:
    """The rate of one large square matmul in `dtype` on `device` (smaller on a CPU), median of `repeats`."""
    n = n if device.startswith("cuda") else 512
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    a @ b  # warm-up: kernel selection
    seconds = statistics.median(timed(lambda: a @ b, device) for _ in range(repeats))
    return 2 * n**3 / seconds / 1e12
