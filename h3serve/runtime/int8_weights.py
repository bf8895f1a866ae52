"""int8 block linears with per-output-channel fp32 scales (`[dit] weights = "int8"`), for the 4 x 22 GB box.

The released transformer is 61.7 GiB in bf16: a quarter per rank does not fit a 22 GB card beside the encoder and
the VAE, and offloaded to host memory it does not fit a 64 GB host (docs/turing-memory.md). Its block linears in
int8 (33.1 B parameters, ~31 GiB, ~7.7 GiB a rank of four) fit the cards, so nothing is pinned on the host. Each
weight is widened to fp16 as its linear runs and takes the scaled fp16 GEMM (h3serve/runtime/fp16_linears.py).

The scale is per output channel (a row of the weight), so a rank quantises its own FSDP2 rows from the same rows
of the source (fp16_linears.ConvertedRows): no rank, and no host, ever holds a whole bf16 copy.
"""

from __future__ import annotations

import torch

LEVELS = 127  # symmetric: -127..127, so the scale maps a row's largest |w| to 127 exactly
SCALE_FLOOR = 1e-12  # a row of zeros gets this scale (and zeros), not 0/0
SCALE_SUFFIX = "_scale"  # `<linear>.weight_scale`: the fp16_linears.ScaledFp16Linear parameter
BLOCKS = "transformer_blocks."  # the linears held in int8: the blocks'


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, fp32 scale per output channel) with weight ~= int8 * scale[:, None]. On the meta device: the
    shapes and dtypes only (a skeleton to shard before its rows are filled)."""
    if weight.is_meta:
        return (
            torch.empty(weight.shape, dtype=torch.int8, device="meta"),
            torch.empty(weight.shape[0], dtype=torch.float32, device="meta"),
        )
    rows = weight.to(torch.float32, copy=True)  # divided in place below: never the caller's tensor
    scale = rows.abs().amax(dim=1).clamp_min(SCALE_FLOOR) / LEVELS
    return rows.div_(scale[:, None]).round_().clamp_(-LEVELS, LEVELS).to(torch.int8), scale
