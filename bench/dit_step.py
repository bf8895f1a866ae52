"""DiT step time and accuracy: diffusers' in-process core denoise step vs the DiT service's runner.

Both run in one process, on the same transformer (full released size, random weights built
directly on the GPU; `--quick`: the tiny preset on CPU), the same inputs and the same seed. A
"step" is one transformer forward plus the scheduler updates; each timed call runs `--forwards`
of them and includes the layout and noise set-up, exactly what a request pays.

The baseline (diffusers, native attention, eager) is timed first at every size; then each
`--variants` entry of the service's fast path (h3serve/runtime/fastpath.py) is applied to the same
transformer and timed. Variants are applied in order and may only add to the previous one
(compile and fp8 cannot be undone in place), e.g.
`native,flash4,flash4+compile,flash4+compile+fp8,cudnn_fp8+compile+fp8`.
With `--errors`, each variant's forward is also compared with an fp32 forward of the same weights
and inputs (and with bf16 eager). Every record carries the achieved TFLOP/s of the counted forward FLOPs
and the device's matmul rate measured in the same run (bench/flops.py). Prints a table; `--write` updates
bench/results.json and BENCHMARKS.md; `--profile` adds each variant's kernel time breakdown (bench/profile.py).

    python -m bench.dit_step --sizes 480x832x124 --variants native,flash4+compile --errors --write
    python -m bench.dit_step --quick                                        # CPU smoke test
    H3SERVE_SAGE_TARGET=compute_75 python -m bench.dit_step --sizes 480x832x124 --variants native,sage --errors
                                                           # sage's Turing code path (rel_err_bf16: vs bf16 SDPA)
"""

from __future__ import annotations

import argparse
import datetime
import statistics
from dataclasses import dataclass

import torch

from bench import flops, profile
from bench.accuracy import capture_forward, forward_output, fp32_output, rel_l2
from bench.common import Size, add_variant_arguments, denoise_spec, device_label, software, timed
from bench.results import Record, add_output_arguments, command_line, update_results
from h3serve.runtime import compile_cache, fastpath, random_full
from h3serve.runtime.fastpath import FastPath
from h3serve.runtime.kernels import sage
from h3serve.services.dit.attention import packed_length
from h3serve.services.dit.runner import DenoiseRunner, served

TEXT_TOKENS = 256


def components(quick: bool, device: str, dtype: torch.dtype) -> dict:
    from diffusers.schedulers import MiniMaxH3Scheduler

    if quick:
        from h3serve.runtime.tiny import build_component

        transformer = build_component("transformer")
    else:
        transformer = random_full.build_component("transformer", device, dtype)
    return {
        "transformer": transformer,
        "scheduler": MiniMaxH3Scheduler(shift=12.0),
        "audio_scheduler": MiniMaxH3Scheduler(shift=3.0),
    }


def baseline_pipeline(parts: dict):
    from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3CoreDenoiseStep

    pipe = MiniMaxH3CoreDenoiseStep().init_pipeline()
    pipe.set_progress_bar_config(disable=True)  # as the service runner's: a bar would be timed on one side only
    pipe.update_components(**parts)
    return pipe


class Workload:
    """One size: its inputs, the baseline and our runner, both on the shared transformer."""

    def __init__(self, size: Size, parts: dict, args, device: str) -> None:
        self.size, self.args, self.device = size, args, device
        transformer = parts["transformer"]
        self.embeds = torch.randn(
            1, TEXT_TOKENS, transformer.config.text_dim, generator=torch.Generator().manual_seed(0)
        ).to(device, transformer.dtype)
        self.tags = torch.ones(TEXT_TOKENS, dtype=torch.int64)  # the layout is built on the CPU
        self.baseline, self.ours = baseline_pipeline(parts), DenoiseRunner(parts, served(["t2va"]))
        self.spec = denoise_spec(size, args.forwards)
        self.flops = flops.dit_forward_flops(transformer, packed_length(TEXT_TOKENS, self.spec, {}))

    def run_baseline(self, steps: int | None = None) -> None:
        self.baseline(
            prompt_embeds=self.embeds,
            text_token_tags=self.tags,
            height=self.size.height,
            width=self.size.width,
            num_frames=self.size.frames,
            num_inference_steps=steps or self.spec.params.num_inference_steps,
            generator=torch.Generator().manual_seed(0),
            output=["latents", "audio_latents"],
        )

    def run_ours(self) -> None:
        self.ours.run(self.spec, self.embeds, self.tags, lambda step, total: None)

    def seconds_per_step(self, fn) -> Timing:
        """The first call (kernels, allocator, compile: what a new shape costs a request), then the median s/step
        and peak GiB of --repeats calls."""
        with torch.no_grad():
            graphs = compile_cache.compiled_graphs()
            first = timed(fn, self.device)
            graphs = compile_cache.compiled_graphs() - graphs
            if self.device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            times = [timed(fn, self.device) / self.args.forwards for _ in range(self.args.repeats)]
        peak = torch.cuda.max_memory_allocated() / 2**30 if self.device.startswith("cuda") else 0.0
        return Timing(statistics.median(times), round(peak, 2), first, graphs)


@dataclass(frozen=True)
class Timing:
    per_step: float
    peak_gib: float
    first_call: float  # seconds of the first call at this size (--forwards forwards)
    graphs: int  # graphs torch.compile built during it


@dataclass
class Accuracy:
    """The fp32 and bf16-eager outputs of one captured forward, and distances to them."""

    inputs: tuple
    fp32: torch.Tensor | None  # None with --errors bf16: an 80 GB card cannot hold the fp32 copy of the DiT
    bf16: torch.Tensor

    @classmethod
    def measure(cls, workload: Workload, transformer, reference: str) -> Accuracy:
        inputs = capture_forward(transformer, lambda: workload.run_baseline(steps=2))
        fp32 = fp32_output(transformer, inputs) if reference == "fp32" else None
        return cls(inputs, fp32, forward_output(transformer, inputs))

    def of(self, transformer, lossy: bool) -> dict:
        out = forward_output(transformer, self.inputs)
        return {
            "rel_err_fp32": None if self.fp32 is None else rel_l2(out, self.fp32),
            "bf16_rel_err_fp32": None if self.fp32 is None else rel_l2(self.bf16, self.fp32),
            "rel_err_bf16": rel_l2(out, self.bf16) if lossy else None,
        }


class FastPathLadder:
    """Applies the --variants in order to one transformer; each may only add fp8 or compile (static and dynamic
    compiles replace each other)."""

    def __init__(self, transformer) -> None:
        self.transformer, self.applied = transformer, FastPath()

    def step_to(self, fast: FastPath) -> None:
        undone = [flag for flag in ("compile", "fp8") if getattr(self.applied, flag) and not getattr(fast, flag)]
        if undone:
            raise SystemExit(f"--variants: {fast.describe()} would undo {', '.join(undone)}; list it earlier")
        quantise = fast.fp8 and not self.applied.fp8  # compiled blocks traced the bf16 linears: compiled again
        recompile = fast.compile and (not self.applied.compile or fast.dynamic != self.applied.dynamic or quantise)
        if self.applied.compile and (recompile or fast.attention != self.applied.attention):
            torch._dynamo.reset()  # the compiled blocks traced the previous kernel or sizes
        fastpath.set_attention(self.transformer, fast.attention)
        if quantise:
            fastpath.quantize_fp8(self.transformer)
        if recompile:
            fastpath.compile_blocks(self.transformer, fast)
        self.applied = fast


def parse_variant(text: str) -> FastPath:
    attention, *flags = text.split("+")
    unknown = set(flags) - set(fastpath.FLAGS)
    if unknown:
        raise SystemExit(
            f"--variants: unknown option(s) {sorted(unknown)} in {text!r} (known: {', '.join(fastpath.FLAGS)})"
        )
    try:
        return FastPath(attention=attention, **{flag: flag in flags for flag in fastpath.FLAGS})
    except ValueError as exc:
        raise SystemExit(f"--variants {text!r}: {exc}") from exc


def run(sizes: list[Size], parts: dict, args, device: str) -> list[Record]:
    transformer = parts["transformer"]
    workloads = [Workload(size, parts, args, device) for size in sizes]
    accuracy = {w.size: Accuracy.measure(w, transformer, args.errors) for w in workloads} if args.errors else {}
    baseline = {w.size: w.seconds_per_step(w.run_baseline) for w in workloads}
    ceiling = flops.matmul_ceiling_tflops(device, transformer.dtype)
    ladder, records = FastPathLadder(transformer), []
    for fast in (parse_variant(v) for v in args.variants.split(",")):
        ladder.step_to(fast)
        for w in workloads:
            ours, base = w.seconds_per_step(w.run_ours), baseline[w.size]
            lossy = fast.lossy or fast.attention == sage.NAME  # int8 Q.K: the difference from bf16 is stated
            errors = accuracy[w.size].of(transformer, lossy=lossy) if w.size in accuracy else {}
            rate = {"tflops": w.flops / ours.per_step / 1e12, "ceiling_tflops": ceiling}
            records.append(record(w.size, fast, ours, base, {**errors, **rate}, args, device))
            if fast.compile:  # what a request of a shape not compiled yet pays
                records.append(first_call_record(w.size, fast, ours, base, args, device))
            print(
                f"  {w.size} {fast.describe()}: {ours.per_step:.4f} s/step vs {base.per_step:.4f} {errors}; first "
                f"call {ours.first_call:.1f} s ({ours.graphs} graphs) vs {base.first_call:.1f} s",
                flush=True,
            )
            if args.profile:
                with torch.no_grad():
                    rows = profile.kernels(w.run_ours, per=args.forwards)
                profile.print_breakdown(f"one step, {w.size}, {fast.describe()}", rows)
    return records


def record(size: Size, fast: FastPath, ours: Timing, base: Timing, measured: dict, args, device: str) -> Record:
    return Record(
        name=f"dit_step_{size}",
        device=device_label(device),
        world_size=1,
        dtype=str(args.dtype),
        seconds=ours.per_step,
        baseline_seconds=base.per_step,
        ratio=base.per_step / ours.per_step,
        peak_gib=ours.peak_gib,
        command=args.command,
        date=datetime.date.today().isoformat(),
        variant=f"service runner, fast path {fast.describe()}{sage_binary(fast, device)}",
        baseline="diffusers MiniMaxH3CoreDenoiseStep (native attention, eager), in process",
        software=software(),
        **measured,
    )


def sage_binary(fast: FastPath, device: str) -> str:
    """Which binary of the sage kernel ran: the card's CUBIN, or Turing's PTX forced through the driver's JIT
    (H3SERVE_SAGE_TARGET=compute_75), whose time is no Turing figure."""
    if fast.attention != sage.NAME or not device.startswith("cuda"):
        return ""
    target = sage.target_for(torch.cuda.get_device_capability())
    return f" (sage from {target}{', JIT: not a Turing figure' if target.startswith('compute_') else ''})"


def first_call_record(size: Size, fast: FastPath, ours: Timing, base: Timing, args, device: str) -> Record:
    return Record(
        name=f"dit_first_call_{size}",
        device=device_label(device),
        world_size=1,
        dtype=str(args.dtype),
        seconds=ours.first_call,
        baseline_seconds=base.first_call,
        ratio=base.first_call / ours.first_call,
        peak_gib=ours.peak_gib,
        command=args.command,
        date=datetime.date.today().isoformat(),
        variant=f"service runner, fast path {fast.describe()}: first call of {args.forwards} forwards at this size "
        f"after the variants before it; graphs compiled: {ours.graphs}",
        baseline="diffusers MiniMaxH3CoreDenoiseStep (native attention, eager), in process: its first call",
        software=software(),
    )


def main(argv: list[str] | None = None) -> list[Record]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_variant_arguments(p, sizes="768x1344x124,480x832x124", repeats=3)
    p.add_argument("--forwards", type=int, default=2, help="transformer forwards per timed call")
    p.add_argument("--profile", action="store_true", help="print each variant's kernel time breakdown (CUDA)")
    add_output_arguments(p)
    args = p.parse_args(argv)
    args.command = command_line("bench.dit_step", argv)
    if args.quick:
        args.sizes, args.dtype = "32x64x124", "float32"
    device = "cpu" if args.quick else "cuda"
    parts = components(args.quick, device, getattr(torch, args.dtype))
    records = run([Size.parse(s) for s in args.sizes.split(",")], parts, args, device)
    print(
        f"{'measurement':24} {'variant':44} {'ours s':>8} {'diffusers s':>11} {'ratio':>6} {'peak GiB':>8} "
        f"{'TFLOP/s':>8} {'ceiling':>8} {'err/fp32':>9} {'bf16/fp32':>9}"
    )
    for r in records:
        err = f"{r.rel_err_fp32:9.2e} {r.bf16_rel_err_fp32:9.2e}" if r.rel_err_fp32 is not None else ""
        rate = f"{r.tflops:8.1f} {r.ceiling_tflops:8.1f}" if r.tflops is not None else f"{'':8} {'':8}"
        print(
            f"{r.name:24} {r.variant[:44]:44} {r.seconds:8.4f} {r.baseline_seconds:11.4f} {r.ratio:6.3f} "
            f"{r.peak_gib:8.2f} {rate} {err}"
        )
    if args.write:
        update_results(records, args.results, args.markdown)
    return records


if __name__ == "__main__":
    main()
