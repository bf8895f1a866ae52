"""Where a call's GPU time goes: its kernels, grouped into attention, GEMM, compiled elementwise and other.

The profiler evidence behind a missed target: `python -m bench.dit_step ... --profile` prints this
table for the last variant at each size.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

import torch

GROUPS = (  # first match wins: FlashAttention 4's kernels are CUTLASS kernels too
    ("attention", re.compile(r"flash|fmha|sdpa|attn|attention", re.I)),
    ("GEMM", re.compile(r"gemm|nvjet|xmma|cutlass|matmul|wgmma", re.I)),
    ("compiled elementwise (Triton)", re.compile(r"^triton_", re.I)),
)


@dataclass(frozen=True)
class Kernel:
    name: str
    group: str
    ms: float
    calls: int


def group_of(name: str) -> str:
    return next((group for group, pattern in GROUPS if pattern.search(name)), "other")


def kernels(fn, per: int = 1) -> list[Kernel]:
    """The CUDA kernels of one call of `fn`, slowest first; times divided by `per` (e.g. forwards per call)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        if us > 0:
            rows.append(Kernel(event.key, group_of(event.key), us / 1000 / per, event.count // per))
    return sorted(rows, key=lambda k: -k.ms)


def print_breakdown(title: str, rows: list[Kernel], top: int = 12) -> None:
    total = sum(k.ms for k in rows) or 1.0
    by_group: dict[str, float] = defaultdict(float)
    for k in rows:
        by_group[k.group] += k.ms
    print(f"GPU time of {title}: {total:.1f} ms")
    for group, ms in sorted(by_group.items(), key=lambda item: -item[1]):
        print(f"  {group:32} {ms:10.1f} ms {100 * ms / total:5.1f} %")
    for k in rows[:top]:
        print(f"    {k.ms:9.1f} ms {k.calls:5d} x  [{k.group}] {k.name[:110]}")
