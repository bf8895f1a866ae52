"""A CPU model of the sage_fp16 kernel's arithmetic, and fp64 attention to hold it to (tests/test_sage_numerics.py,
bench/sage_turing.py, bench/sage_rows.py).

The model takes the kernel's own inputs (h3serve/runtime/kernels/sage_prepare.py runs here as on the GPU) and repeats
its loop: 64-key tiles, int8 Q.K^T exact in int32 (the first 16 channels' sum times 2**shift), scores =
float(int32) * (q_scale[row] * k_scale[key]) in fp32, online
softmax in fp32 with exp2, P rounded to fp16, P.V accumulated in fp32, O * (1 / l) * v_scale rounded to bf16. Two
points differ from the kernel by less than the bars can see: its ex2.approx (2 ulp) and its fp32 summation order.
"""

from __future__ import annotations

import dataclasses

import torch

from h3serve.runtime.kernels import sage_prepare
from h3serve.runtime.kernels.sage_prepare import BLOCK_K, HEAD_DIM, OUTLIER_CHANNELS, Prepared

MODEL_ULPS = 2  # the kernel may differ from the model by this many bf16 ulps (of the output's largest value)
MODEL_MISMATCH = 0.01  # in at most this fraction of the outputs
TENSOR_FIELDS = ("q", "q_scale", "k", "k_scale", "shift", "vt", "v_scale")


def kernel_model(p: Prepared, queries: int | None = None) -> torch.Tensor:
    """What the kernel writes, (batch, rows, heads, HEAD_DIM) bf16; only the first `queries` rows if given (every
    query row's arithmetic is its own: a full-size run on a sample of rows, bench/sage_rows.py)."""
    queries = p.rows if queries is None else min(queries, p.rows)
    q8, k8, vt = p.q[:, :queries].double(), p.k.double(), p.vt.float()
    q_scale = p.q_scale[:, :queries]  # (batch*heads, queries)
    shift = torch.exp2(p.shift.double())[:, None, None]
    m = torch.full(q_scale.shape, float("-inf"))
    total = torch.zeros(q_scale.shape)  # the softmax denominator
    o = torch.zeros(*q_scale.shape, HEAD_DIM)
    keys = torch.arange(BLOCK_K)
    for tile in range(p.n_pad // BLOCK_K):
        window = slice(tile * BLOCK_K, (tile + 1) * BLOCK_K)
        first, rest = slice(0, OUTLIER_CHANNELS), slice(OUTLIER_CHANNELS, HEAD_DIM)
        acc = q8[..., first] @ k8[:, window, first].transpose(1, 2) * shift  # exact in fp64, as in int32
        acc = (acc + q8[..., rest] @ k8[:, window, rest].transpose(1, 2)).float()  # rounded to nearest as cvt.rn
        scores = acc * (q_scale[..., None] * p.k_scale[:, None, window])
        scores = scores.masked_fill(tile * BLOCK_K + keys >= p.rows, float("-inf"))
        m_new = torch.maximum(m, scores.amax(dim=-1))
        alpha = torch.exp2(m - m_new)
        probs = torch.exp2(scores - m_new[..., None])
        total = total * alpha + probs.sum(dim=-1)
        o = o * alpha[..., None] + probs.half().float() @ vt[:, :, window].transpose(1, 2)
        m = m_new
    out = o * (1 / total)[..., None] * p.v_scale[:, None, :]
    out = out.view(p.batch, p.heads, queries, HEAD_DIM).transpose(1, 2)
    return out.to(torch.bfloat16)


def _differ(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a != b).double().mean().item()


def attention_fp64(q, k, v, scale, queries: int | None = None, chunk: int = 1024):
    """(batch, rows, heads, d) attention in fp64 for the first `queries` rows (all by default), `chunk` query
    rows at a time so that full-size rows fit in a few GiB."""
    q, k, v = (t.double().transpose(1, 2) for t in (q[:, :queries], k, v))
    out = [
        torch.softmax(q[:, :, start : start + chunk] @ k.transpose(-1, -2) * scale, dim=-1) @ v
        for start in range(0, q.shape[2], chunk)
    ]
    return torch.cat(out, dim=2).transpose(1, 2)


def kernel_vs_model(loaded, q, k, v) -> dict:
    """The GPU kernel's output (poisoned with NaN before the launch) against the model's, both from the inputs the
    GPU's pre-pass made (the kernel's own arithmetic alone); and how far the CPU's pre-pass differs from the GPU's
    (its scales and int8 roundings), which the model's tests on the CPU start from."""
    from h3serve.runtime.kernels import sage

    prepared = sage_prepare.prepare(q.cuda(), k.cuda(), v.cuda(), HEAD_DIM**-0.5)
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    sage.launch(loaded, prepared, out)
    torch.cuda.synchronize()
    on_cpu = dataclasses.replace(prepared, **{f: getattr(prepared, f).cpu() for f in TENSOR_FIELDS})
    got = out.cpu().double()
    want = kernel_model(on_cpu).double()
    ulp = want.abs().max().item() * 2.0**-7  # a bf16 ulp at the largest output
    difference = (got - want).abs()
    mismatch = (difference > 0).double().mean().item()
    cpu_prepared = sage_prepare.prepare(q.cpu(), k.cpu(), v.cpu(), HEAD_DIM**-0.5)
    return {
        "written": bool(torch.isfinite(got).all()),
        "max_ulps": (difference.max() / ulp).item(),
        "mismatch": mismatch,
        "prepass_int8_differ": {f: _differ(getattr(cpu_prepared, f), getattr(on_cpu, f)) for f in "qk"},
        "matches": bool(difference.max() <= MODEL_ULPS * ulp) and mismatch <= MODEL_MISMATCH,
    }
