"""The sage_fp16 kernel's CPU model (bench/sage_model.py) against fp64 attention at the full-size DiT's row counts.

No GPU: the model is the kernel's exact arithmetic (a lent H100 matched it to 0.31 bf16 ulp), so its errors at
15,100 and 37,966 rows (480x832x124, 768x1344x124) are the kernel's. The suite runs 1,000 rows; the DiT-like
error grows with the rows (more keys, sharper winners), which is why this run exists. Each quantisation idea is a
variant of the same pre-pass and model:
- `16/64`: one int8 scale per 16 query rows and per 64 keys (the kernel before per-row scales), `16/16`, `1/64`,
  `16/1`, `1/1` (one per query row and per key), all without the outlier channels' shift;
- `1/1+outliers`: per-row scales and each head's 16 outlier channels first, divided by 2**shift (the op's);
- `1/1+balanced`: per-row scales after a per-channel pre-scale q_c * s_c, k_c / s_c (exact for Q.K^T), s_c the
  power of two nearest sqrt(amax K_c / amax Q_c) per head, which moves outlier magnitude between Q and K;
- `1/1+oracle`: the same with s_c = sqrt(2) on the DiT-like case's known outlier channels (the best of s in
  0.7..2.8 measured on 15,100 rows): what an ideal channel pre-scale could add, not a rule.
Inputs as bench/sage_turing.py makes them on a GPU (the CPU's generator: other draws, the same distributions),
`--heads` of them; `--queries` computes only the first query rows of each head against every key (each row's
arithmetic is its own, so a sample of rows measures the same error for a fraction of the time). The fp64
reference runs 1,024 query rows at a time. Prints a table; writes $OUT/sage_rows.json when $OUT is set.

    python -m bench.sage_rows --rows 15100,37966 --heads 2 --queries 2048
    python -m bench.sage_rows --rows 15100,37966 --heads 2 --variants 16/64,1/1+outliers
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch

from bench.sage_model import attention_fp64, kernel_model
from bench.sage_turing import CASES, HEAD_DIM, OUTLIER_CHANNELS, compare, inputs
from h3serve.runtime.kernels import sage_prepare

SCALE_ROWS = {"16/64": (16, 64), "16/16": (16, 16), "1/64": (1, 64), "16/1": (16, 1), "1/1": (1, 1)}
EXTRAS = ("outliers", "balanced", "oracle")


def channel_scale(q: torch.Tensor, k: torch.Tensor, kind: str) -> torch.Tensor:
    """s (heads, HEAD_DIM) for q * s, k / s."""
    if kind == "oracle":
        s = torch.ones(q.shape[2], HEAD_DIM)
        s[:, OUTLIER_CHANNELS] = math.sqrt(2)
        return s
    smoothed = k.float() - k.float().mean(dim=1, keepdim=True)
    q_max, k_max = (x.abs().amax(dim=(0, 1)).clamp_min(1e-30) for x in (q.float(), smoothed))
    return torch.exp2(torch.round(0.5 * torch.log2(k_max / q_max)))  # a power of two: q * s, k / s exact


def measure(case_inputs: list[torch.Tensor], variant: str, queries: int) -> dict[str, float]:
    """The model's output for the first `queries` rows against fp64 attention of the case's bf16 q, k, v."""
    q, k, v = case_inputs
    blocks, _, extra = variant.partition("+")
    if extra in ("balanced", "oracle"):
        s = channel_scale(q, k, extra)
        q, k = q.float() * s, k.float() / s  # the same Q.K^T in real arithmetic
    max_shift = sage_prepare.OUTLIER_SHIFT_MAX if extra == "outliers" else 0
    prepared = sage_prepare.prepare(q, k, v, HEAD_DIM**-0.5, SCALE_ROWS[blocks], max_shift)
    return compare(kernel_model(prepared, queries), attention_fp64(*case_inputs, HEAD_DIM**-0.5, queries))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="15100,37966")
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--queries", type=int, default=None, help="the first query rows of each head (default all)")
    p.add_argument("--cases", default="dit-like,gaussian", help=f"of {', '.join(CASES)}")
    variants = [*SCALE_ROWS, *(f"1/1+{extra}" for extra in EXTRAS)]
    p.add_argument("--variants", default=",".join(variants), help=f"of {', '.join(variants)}")
    args = p.parse_args(argv)
    results = []
    for rows in map(int, args.rows.split(",")):
        for case in args.cases.split(","):
            case_inputs = inputs(case, rows, args.heads, device="cpu")
            bar = CASES[case]
            for variant in args.variants.split(","):
                started = time.monotonic()
                measured = measure(case_inputs, variant, args.queries or rows)
                met = measured["cosine"] >= bar["cosine"] and measured["rel_l1"] <= bar["rel_l1"]
                results.append({"rows": rows, "case": case, "variant": variant, **measured, "meets_bar": met})
                print(
                    f"{rows:6d} x {args.heads} heads, {args.queries or rows} queries, {case:9} {variant:14} cosine "
                    f"{measured['cosine']:.6f} rel L1 {measured['rel_l1']:.4f} (bar {bar['cosine']}, "
                    f"{bar['rel_l1']}): {'met' if met else 'MISSED'} ({time.monotonic() - started:.0f} s)",
                    flush=True,
                )
    if out := os.environ.get("OUT"):
        Path(out, "sage_rows.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
