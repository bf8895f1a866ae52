"""The sage_fp16 attention kernel's Turing code path on a lent GPU: its numbers against fp32 SDPA, and its time.

No Turing card is lent, so the kernel is loaded from its compute_75 PTX (H3SERVE_SAGE_TARGET=compute_75: NVRTC
emits Turing's PTX and the driver JIT-compiles it for this card at cuModuleLoadData; the loaded function's PTX
version, 75, proves which module runs). The instructions are Turing's own (m8n8k16 IMMA, m16n8k8 HMMA), so its
numbers are the ones a 2080 Ti computes; its speed and Turing's resource limits are not (the sm_75 CUBIN's SASS
and resource usage are checked on the CPU, tests/test_sage_sass.py). Every time is labelled so.

First the kernel (PTX and native CUBIN) against its CPU model (bench/sage_model.py), both fed the inputs the GPU's
pre-pass made, on (1, 1000, 2, 128), Gaussian and DiT-like (whose outlier channels take the kernel's shifted first
step): the same numbers up to the kernel's ex2.approx and summation order. Then at the full-size DiT's attention shapes
(1, 15100 / 37966, 56, 128) (480x832x124, 768x1344x124):
- the bars of issue 49 against fp32 SDPA (memory-efficient kernel): Gaussian inputs cosine >= 0.9999 and
  relative L1 <= 0.015; DiT-like (a per-channel K bias x8, 4 outlier channels x4 in Q and K) cosine >= 0.999,
  relative L1 <= 0.03; same-sign |V| ~ 4e3 and ~ 1e5 (beyond fp16) finite, at the Gaussian bar;
- every output poisoned with NaN before the launch (a row not written shows), CUDA errors checked after each;
- times (CUDA events, median of --repeats after warm-up): the op as the model calls it (pre-pass + kernel) and
  the kernel alone, from the compute_75 PTX and from the native sm_90 CUBIN, beside bf16 SDPA (cuDNN, flash).
Prints a table; writes $OUT/sage_turing.json when $OUT is set; --write adds rows to BENCHMARKS.md and
bench/results.json, each naming the card.

    python -m bench.sage_turing --write
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.common import device_label, software
from bench.results import Record, add_output_arguments, command_line, update_results
from bench.sage_model import kernel_vs_model
from h3serve.runtime.kernels import nvrtc_cache, sage, sage_prepare

SHAPES = {"480x832x124": 15100, "768x1344x124": 37966}
HEADS, HEAD_DIM = 56, 128
GAUSSIAN = {"cosine": 0.9999, "rel_l1": 0.015}
DIT_LIKE = {"cosine": 0.999, "rel_l1": 0.03}
PTX_TARGET = "compute_75"
OUTLIER_CHANNELS = [3, 40, 77, 120]


def inputs(case: str, rows: int, heads: int = HEADS, device: str = "cuda") -> list[torch.Tensor]:
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, rows, heads, HEAD_DIM, device=device, generator=generator) for _ in range(3))
    if case == "dit-like":
        k += 8 * torch.randn(heads, HEAD_DIM, device=device, generator=generator)
        q[..., OUTLIER_CHANNELS] *= 4
        k[..., OUTLIER_CHANNELS] *= 4
    elif case.startswith("same-sign"):
        v = float(case.split()[-1]) * (1 + 0.1 * v)
    return [t.bfloat16() for t in (q, k, v)]


CASES = {"gaussian": GAUSSIAN, "dit-like": DIT_LIKE, "same-sign |V| 4e3": GAUSSIAN, "same-sign |V| 1e5": GAUSSIAN}


def fp32_sdpa(q, k, v) -> torch.Tensor:
    """fp32 attention without the S x S scores (the memory-efficient kernel takes fp32; MATH is not allowed)."""
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        out = F.scaled_dot_product_attention(*(t.float().transpose(1, 2) for t in (q, k, v)))
    return out.transpose(1, 2)


def run_poisoned(loaded: sage.Kernel, q, k, v) -> torch.Tensor:
    prepared = sage_prepare.prepare(q, k, v, HEAD_DIM**-0.5)
    out = torch.full(q.shape, float("nan"), device="cuda", dtype=torch.bfloat16)
    sage.launch(loaded, prepared, out)
    torch.cuda.synchronize()  # raises on an error the launch left behind
    return out


def compare(got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    got, want = got.double().flatten(), want.double().flatten()
    return {
        "finite": bool(torch.isfinite(got).all()),
        "cosine": F.cosine_similarity(got, want, dim=0).item(),
        "rel_l1": ((got - want).abs().sum() / want.abs().sum()).item(),
        "rel_l2": (torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want)).item(),
    }


def median_ms(fn, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def load_ptx_kernel(device: int) -> sage.Kernel:
    """The kernel from Turing's PTX, as the op loads it when H3SERVE_SAGE_TARGET=compute_75, checked to be it."""
    os.environ[sage.TARGET_ENV] = PTX_TARGET
    loaded = sage.kernel(device, sage.target_for(torch.cuda.get_device_capability(device)))
    assert loaded.binary.target == PTX_TARGET and loaded.binary.image.startswith(b"//"), "not the PTX image"
    assert b".target sm_75" in loaded.binary.image, "the PTX is not Turing's"
    assert loaded.ptx_version == 75, f"the loaded function says PTX version {loaded.ptx_version}, not 75"
    print(
        f"forced by {sage.TARGET_ENV}={PTX_TARGET}: NVRTC {nvrtc_cache.nvrtc_version()} emitted compute_75 PTX "
        f"(.target sm_75), loaded with cuModuleLoadData, JIT-compiled by the driver: the function reports PTX "
        f"version {loaded.ptx_version}, binary version {loaded.binary_version}",
        flush=True,
    )
    print(f"  {loaded.describe(torch.device('cuda', device))}", flush=True)
    return loaded


def against_model(loaded: sage.Kernel) -> dict:
    """Gaussian inputs and the DiT-like ones (whose outlier channels take the kernel's shifted first step)."""
    results = {}
    for case in ("gaussian", "dit-like"):
        measured = kernel_vs_model(loaded, *inputs(case, 1000, heads=2, device="cpu"))
        print(
            f"  {loaded.binary.target} against the CPU model, {case}: every output written {measured['written']}, "
            f"{measured['mismatch']:.2%} differ, by at most {measured['max_ulps']:.2f} bf16 ulp: "
            f"{'matches' if measured['matches'] else 'DOES NOT MATCH'} (both from the GPU's pre-pass; the CPU's "
            f"int8 Q / K differ from it in {measured['prepass_int8_differ']['q']:.3%} / "
            f"{measured['prepass_int8_differ']['k']:.3%} of entries)",
            flush=True,
        )
        results[case] = measured
    return {
        "written": all(m["written"] for m in results.values()),
        "matches": all(m["matches"] for m in results.values()),
        **results,
    }


def accuracy(loaded: sage.Kernel, rows: int) -> dict[str, dict]:
    results = {}
    for case, bar in CASES.items():
        q, k, v = inputs(case, rows)
        measured = compare(run_poisoned(loaded, q, k, v), fp32_sdpa(q, k, v))
        measured["meets_bar"] = (
            measured["finite"] and measured["cosine"] >= bar["cosine"] and (measured["rel_l1"] <= bar["rel_l1"])
        )
        results[case] = measured
        print(
            f"  {rows:6d} {case:18} cosine {measured['cosine']:.6f} (>= {bar['cosine']}), rel L1 "
            f"{measured['rel_l1']:.4f} (<= {bar['rel_l1']}), finite {measured['finite']}: "
            f"{'meets the bar' if measured['meets_bar'] else 'MISSES THE BAR'}",
            flush=True,
        )
        del q, k, v
        torch.cuda.empty_cache()
    return results


def timings(ptx: sage.Kernel, native: sage.Kernel, rows: int, repeats: int) -> dict[str, float]:
    q, k, v = inputs("gaussian", rows)
    prepared = sage_prepare.prepare(q, k, v, HEAD_DIM**-0.5)
    out = torch.empty(q.shape, device="cuda", dtype=torch.bfloat16)
    sdpa_inputs = [t.transpose(1, 2) for t in (q, k, v)]  # as diffusers' native backend calls it

    def sdpa(backend):
        def call():
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(*sdpa_inputs)

        return call

    ms = {
        "sage op, compute_75 PTX (pre-pass + kernel)": median_ms(lambda: sage.attention(q, k, v), repeats),
        "sage kernel, compute_75 PTX": median_ms(lambda: sage.launch(ptx, prepared, out), repeats),
        "sage kernel, native sm_90 CUBIN": median_ms(lambda: sage.launch(native, prepared, out), repeats),
        "sage pre-pass alone": median_ms(lambda: sage_prepare.prepare(q, k, v, HEAD_DIM**-0.5), repeats),
        "SDPA bf16 cuDNN": median_ms(sdpa(SDPBackend.CUDNN_ATTENTION), repeats),
        "SDPA bf16 flash": median_ms(sdpa(SDPBackend.FLASH_ATTENTION), repeats),
    }
    for name, value in ms.items():
        tflops = 4 * rows * rows * HEADS * HEAD_DIM / value / 1e9
        print(f"  {rows:6d} {name:44} {value:9.2f} ms {tflops:7.1f} TFLOP/s", flush=True)
    return ms


def records(shape: str, rows: int, measured: dict, ms: dict, args) -> list[Record]:
    card = device_label("cuda")
    gaussian, dit = measured["gaussian"], measured["dit-like"]
    numbers = (
        f"vs fp32 SDPA: Gaussian cosine {gaussian['cosine']:.6f} rel L1 {gaussian['rel_l1']:.4f}; DiT-like cosine "
        f"{dit['cosine']:.6f} rel L1 {dit['rel_l1']:.4f}; same-sign abs V 4e3 and 1e5 finite "
        f"{measured['same-sign |V| 4e3']['finite'] and measured['same-sign |V| 1e5']['finite']}"
    )
    common = dict(
        world_size=1,
        dtype="bfloat16",
        baseline="SDPA bf16 cuDNN (same card, same run)",
        baseline_seconds=ms["SDPA bf16 cuDNN"] / 1e3,
        peak_gib=0.0,
        command=args.command,
        date=datetime.date.today().isoformat(),
        software=f"{software()}, NVRTC {nvrtc_cache.nvrtc_version()}",
        rel_err_fp32=gaussian["rel_l2"],
    )
    variants = {
        "sage op, compute_75 PTX (pre-pass + kernel)": (
            f"{card}, compute_75 PTX JIT: not a Turing figure",
            f"sage_fp16 op (pre-pass + kernel), Turing PTX JIT-compiled by the driver ({sage.TARGET_ENV}="
            f"{PTX_TARGET}): not a Turing figure; {numbers}",
        ),
        "sage kernel, native sm_90 CUBIN": (
            f"{card}, native sm_90 CUBIN",
            "sage_fp16 kernel alone (no pre-pass), NVRTC CUBIN for this card",
        ),
    }
    return [
        Record(
            name=f"sage_attention_{shape}",
            device=device,
            seconds=ms[key] / 1e3,
            ratio=ms["SDPA bf16 cuDNN"] / ms[key],
            variant=variant,
            **common,
        )
        for key, (device, variant) in variants.items()
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    p.add_argument("--repeats", type=int, default=10)
    add_output_arguments(p)
    args = p.parse_args(argv)
    args.command = command_line("bench.sage_turing", argv)
    started = time.monotonic()
    device = torch.cuda.current_device()
    capability = torch.cuda.get_device_capability(device)
    print(f"{torch.cuda.get_device_name(device)} (sm_{capability[0]}{capability[1]}), {software()}", flush=True)
    ptx = load_ptx_kernel(device)
    native = sage.kernel(device, f"sm_{capability[0]}{capability[1]}")
    print(f"  {native.describe(torch.device('cuda', device))}", flush=True)
    model = {name: against_model(loaded) for name, loaded in (("compute_75 PTX", ptx), ("native CUBIN", native))}
    results: dict[str, dict] = {}
    rows_out: list[Record] = []
    for shape in args.shapes.split(","):
        rows = SHAPES[shape]
        print(f"{shape}: (1, {rows}, {HEADS}, {HEAD_DIM})", flush=True)
        measured = accuracy(ptx, rows)
        ms = timings(ptx, native, rows, args.repeats)
        results[shape] = {"accuracy": measured, "ms": ms}
        rows_out += records(shape, rows, measured, ms, args)
    met = all(m["meets_bar"] for shape in results.values() for m in shape["accuracy"].values())
    met = met and all(m["matches"] and m["written"] for m in model.values())
    seconds = time.monotonic() - started
    print(f"all bars met: {met}; {seconds:.0f} s", flush=True)
    if out := os.environ.get("OUT"):
        summary = {
            "card": device_label("cuda"),
            "model": model,
            "shapes": results,
            "all_bars_met": met,
            "seconds": seconds,
        }
        Path(out, "sage_turing.json").write_text(json.dumps(summary, indent=1))
    if args.write:
        update_results(rows_out, args.results, args.markdown)


if __name__ == "__main__":
    main()
