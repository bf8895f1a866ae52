"""The torch pre-pass of the sage_fp16 kernel: K smoothed, Q and K to int8 per row, V to fp16 per channel.

It runs on the tensors' own device (the GPU when serving; the CPU model in tests/test_sage_numerics.py runs the
same code), so the kernel's inputs are exactly what the model of its arithmetic is given. Layouts and block
sizes are the kernel's (h3serve/runtime/kernels/sage_fp16/attention.cu says why each is shaped so):
- K minus its mean over the rows, per head: every score of a query row moves by the same amount, so the
  softmax is unchanged and the int8 range is spent on what differs between keys;
- Q and K with one fp32 scale amax / 127 per row (query or key): outlier channels sit in every row, so a
  block's scale would be the largest outlier of all its rows and a row's is only its own (per 16/64-row blocks
  missed the DiT-like bar at full size, docs/turing.md); the softmax scale and log2(e) ride on Q's scale, so
  the kernel's scores are in the exp2 domain;
- per head, the OUTLIER_CHANNELS channels of largest amax(Q_c) * amax(K_c) first (the same order for Q and K,
  exact for Q.K^T; the kernel's first 16-channel step) and divided by a power of two 2**shift (per head, of Q
  and of K: the median row's ratio of their amax to the other channels', at most OUTLIER_SHIFT_MAX) before the
  row's scale is taken, so that the outliers no longer coarsen every other channel; the kernel multiplies that
  step's exact int32 sum by 2**(q shift + k shift) before adding the other steps (bench/sage_rows.py measures it);
- V divided by a power of two per channel that brings its largest |value| under 2**V_RANGE_LOG2: exact for
  bf16 values (fp16 has more mantissa bits) and finite beyond fp16's 65504; the kernel multiplies it back
  in fp32 before rounding to bf16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

HEAD_DIM = 128  # the DiT's; the kernel's fragment loops are unrolled for it
BLOCK_Q = 64  # query rows per thread block
WARP_ROWS = 16  # query rows per warp
BLOCK_K = 64  # keys per tile
SCALE_ROWS = 1  # query rows or keys sharing one int8 scale
OUTLIER_CHANNELS = 16  # one m8n8k16 step: the kernel's first
# per Q and K: the first step's sum times 2**8 stays in int32 (16 * 127**2 * 2**8 + 112 * 127**2 < 2**31)
OUTLIER_SHIFT_MAX = 4
SHIFT_SAMPLE_ROWS = 1024  # rows whose amax ratios choose a head's shift
V_RANGE_LOG2 = 8  # |V / v_scale| < 2**8 in fp16; P <= 1, so P.V cannot approach fp16's range either
INT8_MAX = 127


@dataclass(frozen=True)
class Prepared:
    """The kernel's inputs for (batch, rows, heads, HEAD_DIM) attention; rows padded to `n_pad` with zeros."""

    q: torch.Tensor  # int8 (batch*heads, n_pad, HEAD_DIM)
    q_scale: torch.Tensor  # fp32 (batch*heads, n_pad): per query row, times softmax scale * log2(e)
    k: torch.Tensor  # int8 (batch*heads, n_pad, HEAD_DIM), smoothed
    k_scale: torch.Tensor  # fp32 (batch*heads, n_pad): per key
    shift: torch.Tensor  # int32 (batch*heads,): the first channel step's int32 sum is multiplied by 2**shift
    vt: torch.Tensor  # fp16 (batch*heads, HEAD_DIM, n_pad): V / v_scale, channel-major
    v_scale: torch.Tensor  # fp32 (batch*heads, HEAD_DIM), powers of two
    batch: int
    rows: int
    heads: int

    @property
    def n_pad(self) -> int:
        return self.q.shape[1]


def padded_rows(rows: int) -> int:
    return -(-rows // BLOCK_Q) * BLOCK_Q


def prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    scale_rows: tuple[int, int] = (SCALE_ROWS, SCALE_ROWS),
    max_shift: int = OUTLIER_SHIFT_MAX,
) -> Prepared:
    """(batch, rows, heads, HEAD_DIM) q, k, v of any float dtype -> the kernel's inputs, one int8 scale per
    `scale_rows` (query rows, keys): divisors of BLOCK_K, 1 in the op; the outlier channels' shift at most
    `max_shift` (bench/sage_rows.py measures others).
    Each is copied once to fp32 head-major and worked on in place there: at its peak (V's turn) the pre-pass holds
    int8 Q and K, one fp32 copy and the fp16 V, 8 bytes per element of one input (the op's bf16 output adds 2; the
    per-row scales 8 bytes per row and head, 1/16 byte per element)."""
    batch, rows, heads, head_dim = q.shape
    if head_dim != HEAD_DIM or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"sage_fp16 takes q, k, v of one shape (batch, rows, heads, {HEAD_DIM}); got {q.shape}")
    n_pad = padded_rows(rows)
    order, q_shift, k_shift = outlier_channels(q, k, max_shift)
    q8, q_scale = quantise(head_major(q, n_pad), scale_rows[0], order, q_shift)
    keys = head_major(k, n_pad)
    keys[:, :rows] -= keys[:, :rows].mean(dim=1, keepdim=True)  # the padding rows stay zero
    k8, k_scale = quantise(keys, scale_rows[1], order, k_shift)
    vt, v_scale = fp16_channels(head_major(v, n_pad))
    q_scale *= softmax_scale * math.log2(math.e)
    shift = (q_shift + k_shift).to(torch.int32)
    return Prepared(q8, q_scale, k8, k_scale, shift, vt, v_scale, batch, rows, heads)


def outlier_channels(q: torch.Tensor, k: torch.Tensor, max_shift: int) -> tuple[torch.Tensor, ...]:
    """Per head: the channel order (batch*heads, HEAD_DIM), the OUTLIER_CHANNELS of largest amax(Q_c) *
    amax(K_c - mean) first, and Q's and K's shifts (batch*heads,) within [0, max_shift]: log2 of the median row's
    ratio of those channels' amax to the others', rounded. Not more: in a row whose ratio is below 2**shift
    the outlier channels' step grows past their own amax / 127, and their errors weigh the most (a shift from
    the whole head's amax ratio measured worse, docs/turing.md). Reduced over the inputs as they are; the
    ratios on SHIFT_SAMPLE_ROWS rows of them."""
    batch, rows, heads, d = q.shape
    q_amax = abs_max(q, dim=1).float().view(batch * heads, d)
    k_mean = k.mean(dim=1, dtype=torch.float32)
    k_low, k_high = torch.aminmax(k, dim=1)
    k_amax = torch.maximum(k_high.float() - k_mean, k_mean - k_low.float()).view(batch * heads, d)
    top = torch.topk(q_amax * k_amax, OUTLIER_CHANNELS, dim=1).indices.sort(dim=1).values
    outlier = torch.zeros_like(q_amax, dtype=torch.bool).scatter_(1, top, True)
    rest = torch.argsort(outlier.byte(), dim=1, stable=True)[:, : d - OUTLIER_CHANNELS]  # ascending
    order = torch.cat([top, rest], dim=1)

    def shift(sample: torch.Tensor) -> torch.Tensor:
        """(batch, sampled rows, heads, d) fp32 -> (batch*heads,)"""
        sample = sample.abs().transpose(1, 2).reshape(batch * heads, -1, d)  # not abs_: fp32 q is the caller's
        amax = [
            sample.gather(2, channels[:, None, :].expand(-1, sample.shape[1], -1)).amax(dim=2)
            for channels in (top, rest)
        ]
        ratio = (amax[0] / amax[1].clamp_min(torch.finfo(torch.float32).tiny)).median(dim=1).values
        return torch.log2(ratio).round_().clamp_(0, max_shift).long()

    sample = slice(None, None, max(1, rows // SHIFT_SAMPLE_ROWS))
    return order, shift(q[:, sample].float()), shift(k[:, sample].float() - k_mean[:, None])


def head_major(x: torch.Tensor, n_pad: int) -> torch.Tensor:
    """(batch, rows, heads, d) -> a new fp32 (batch*heads, n_pad, d), the padding rows zero."""
    batch, rows, heads, d = x.shape
    out = torch.zeros(batch * heads, n_pad, d, dtype=torch.float32, device=x.device)
    out.view(batch, heads, n_pad, d)[:, :, :rows].copy_(x.transpose(1, 2))
    return out


def quantise(
    rows: torch.Tensor, block: int, order: torch.Tensor, shift: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (batch*heads, n_pad, d), overwritten -> int8 of the same shape, rounded half to even, its channels in
    `order` and the first OUTLIER_CHANNELS of them divided by 2**shift, and the fp32 scale of each row
    (batch*heads, n_pad): one per `block` rows (the kernel takes any; bench/sage_rows.py measures blocks of 16
    and 64 against the op's one)."""
    divisor = torch.ones(order.shape, device=rows.device).scatter_(
        1, order[:, :OUTLIER_CHANNELS], torch.exp2(shift.float())[:, None].expand(-1, OUTLIER_CHANNELS)
    )
    rows.div_(divisor[:, None, :])  # a power of two: exact
    blocks = rows.view(rows.shape[0], rows.shape[1] // block, block * rows.shape[-1])
    scale = abs_max(blocks, dim=-1).clamp_min(torch.finfo(torch.float32).tiny) / INT8_MAX
    q8 = blocks.div_(scale[..., None]).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8).view(rows.shape)
    return q8.gather(2, order[:, None, :].expand(rows.shape)), scale.repeat_interleave(block, dim=1)


def fp16_channels(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (batch*heads, n_pad, d), overwritten -> V / v_scale in fp16, channel-major (batch*heads, d, n_pad), and
    v_scale (batch*heads, d): per channel the power of two that brings max |V| under 2**V_RANGE_LOG2."""
    _, exponent = torch.frexp(abs_max(rows, dim=1))  # amax < 2**exponent (0 for an all-zero channel)
    scale = torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent - V_RANGE_LOG2)
    vt = torch.empty(rows.shape[0], rows.shape[2], rows.shape[1], dtype=torch.float16, device=rows.device)
    return vt.copy_(rows.div_(scale[:, None, :]).transpose(1, 2)), scale


def abs_max(x: torch.Tensor, dim: int) -> torch.Tensor:
    """max |x| along `dim` without a full-size |x| temporary."""
    low, high = torch.aminmax(x, dim=dim)
    return torch.maximum(-low, high)
