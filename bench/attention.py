"""The DiT's attention kernels alone, at the packed lengths of real requests: time and error against fp32.

Random (1, S, 56, 128) bf16 query/key/value, the model's attention shape, go through diffusers'
dispatcher exactly as the transformer calls it, for each `--backends` entry (a diffusers backend, or
one of the local kernels of h3serve/runtime/kernels/local.py; `+compile` compiles the call, which fuses
the FP8 kernel's scaling). The error is the relative L2 distance of the first 512 query rows from an
fp32 softmax(QK^T)V of the same inputs. Prints a table (no records: the step bench, bench/dit_step.py,
measures what a request pays).

    python -m bench.attention --rows 37966,15100 --backends native,flash4,cudnn_fp8,cudnn_fp8+compile
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch

from bench.accuracy import rel_l2
from bench.common import timed
from h3serve.runtime.kernels import local as local_kernels

HEADS, HEAD_DIM, CHECKED_ROWS = 56, 128, 512


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """fp32 attention output of the first CHECKED_ROWS query rows, one head at a time."""
    heads = []
    for h in range(q.shape[2]):
        scores = q[0, :CHECKED_ROWS, h].float() @ k[0, :, h].float().T * HEAD_DIM**-0.5
        heads.append(scores.softmax(dim=-1) @ v[0, :, h].float())
    return torch.stack(heads, dim=1)


def attention_call(spec: str):
    from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn

    name, *flags = spec.split("+")
    if name in local_kernels.KERNELS:
        local_kernels.bind(name)
        backend = AttentionBackendName.FLASH_4_HUB
    else:
        backend = AttentionBackendName(name)

    def call(q, k, v):
        return dispatch_attention_fn(q, k, v, backend=backend)

    return torch.compile(call, fullgraph=True) if "compile" in flags else call


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="37966,15100", help="packed sequence lengths (768x1344x124, 480x832x124)")
    p.add_argument("--backends", default="native,flash4,cudnn_fp8,cudnn_fp8+compile")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    print(f"{'rows':>6} {'backend':22} {'ms':>8} {'TFLOP/s':>8} {'rel err':>9}")
    for rows in (int(r) for r in args.rows.split(",")):
        generator = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (
            torch.randn(1, rows, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
            for _ in range(3)
        )
        expected = reference(q, k, v)
        for spec in args.backends.split(","):
            call = attention_call(spec)
            with torch.no_grad():
                out = call(q, k, v)
                run = functools.partial(call, q, k, v)
                ms = statistics.median(timed(run, "cuda") for _ in range(args.repeats)) * 1e3
            error = rel_l2(out[0, :CHECKED_ROWS].float(), expected)
            tflops = 4 * rows * rows * HEADS * HEAD_DIM / ms / 1e9
            print(f"{rows:6d} {spec:22} {ms:8.2f} {tflops:8.1f} {error:9.2e}", flush=True)


if __name__ == "__main__":
    main()
