"""DiT step time and memory with the transformer's weights as GGUF files (Q8_0, Q4_0) against bf16 and fp8.

One process, one transformer of the released size with random weights, built in bf16 on the GPU
(h3serve/runtime/random_full.py; `--quick`: the tiny preset on the CPU in float32, a smoke test). Its step is timed
first at every size by bench.dit_step's baseline (diffusers' core denoise step, native attention, eager): the
reference of every ratio. One forward's inputs are captured at each size and its bf16 output kept.

Then each GGUF kind of `--weights`: the bf16 weights are written into `--dir` as a GGUF of the published
single-file layout (bench/checkpoint_files.py `stream_gguf`: quantised on the GPU, one tensor at a time in host
memory), checked and loaded by the DiT's own `transformer_file` path (h3serve/runtime/checkpoints.py: diffusers'
from_single_file, weights kept quantised and dequantised per layer as it runs), moved to the GPU and timed the same
way; the file is deleted once loaded (Q8_0 of the released size is 35 GB, Q4_0 19 GB) and the model freed once timed.
`fp8` runs last, since it converts the bf16 model in place (the fast path's torchao fp8, as bench.dit_step's `+fp8`);
it needs a CUDA GPU, so the CPU skips it. bf16 is always measured: it is the reference.

Each format and size gives: seconds per step (median of `--repeats` after a warm-up), the ratio to bf16's, the
relative L2 of the captured forward's output against bf16's, the weights' bytes on the device, the step's peak GPU
memory (max_memory_allocated) less what the bench held besides these weights (the bf16 model stays on the GPU while
the GGUF ones run), the process's peak resident host memory (VmHWM: bf16's since the start, then restarted at each
format, so a GGUF's covers its writing, loading and steps; it counts the file's pages the loader maps beside its copy)
and the seconds to have the weights on the device. Prints progress lines as it goes and a table at the end; `--write`
records each format's rows, as it ends, in bench/results.json and BENCHMARKS.md's "Weight formats" table. `--dir`
holds one file at a time.

    python -m bench.gguf_step --sizes 480x832x124,768x1344x124 --weights bf16,Q8_0,Q4_0,fp8 --dir /root/gguf --write
    python -m bench.gguf_step --quick --weights bf16,Q8_0,Q4_0,fp8 --dir /tmp/ggq       # CPU smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.accuracy import capture_forward, forward_output, rel_l2
from bench.checkpoint_files import stream_gguf
from bench.common import Size, device_label, software, timed
from bench.dit_step import Timing, Workload, components
from bench.results import Record, add_output_arguments, command_line, update_results
from h3serve.runtime import checkpoints, fastpath, pinned

GGUF_KINDS = ("Q8_0", "Q4_0")
# the order they run in: the GGUFs are written from the bf16 weights, which fp8 converts in place
KINDS = ("bf16", *GGUF_KINDS, "fp8")
VARIANTS = {
    "bf16": "bf16: the transformer's own weights, the reference",
    "Q8_0": "Q8_0: GGUF transformer_file, diffusers' GGUFLinear (dequantised per layer, torch)",
    "Q4_0": "Q4_0: GGUF transformer_file, diffusers' GGUFLinear (dequantised per layer, torch)",
    "fp8": "fp8: torchao rowwise W8A8 on the block linears (the fast path's fp8), eager",
}
BASELINE = "bf16 weights in the same run: diffusers MiniMaxH3CoreDenoiseStep (native attention, eager), in process"


def log(message: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S}] {message}", flush=True)


@dataclass(frozen=True)
class Made:
    """How one format's weights came to be on the device."""

    seconds: float  # bf16: built; GGUF: checked, loaded from the file and moved; fp8: converted
    weights_gib: float
    file_gib: float | None = None


@dataclass(frozen=True)
class Step:
    """One format at one size."""

    size: Size
    timing: Timing
    peak_gib: float  # the step's GPU peak less what the bench held besides these weights
    error: float | None  # relative L2 of the captured forward's output against bf16's (None: bf16 itself)


@dataclass(frozen=True)
class Reference:
    """One size's bf16 forward: its captured inputs and its output, which every format's forward is compared with."""

    inputs: tuple
    output: torch.Tensor


def weight_gib(model: torch.nn.Module) -> float:
    """The model's parameters and buffers as stored: a GGUF weight by its blocks, a torchao fp8 one by its data and
    scales."""
    stored: list[torch.Tensor] = []
    for tensor in [*model.parameters(), *model.buffers()]:
        stored += [getattr(tensor, part) for part in pinned.parts(tensor)] or [tensor]
    return sum(t.numel() * t.element_size() for t in stored) / 2**30


def host_peak_gib() -> float:
    """The process's peak resident size (VmHWM) since it started or `restart_host_peak`."""
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1]) / 2**20


def restart_host_peak() -> None:
    """VmHWM from the current resident size on, so each format's peak is its own (where /proc allows it; else the
    peak since the start, an upper bound)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def timed_value(make: Callable[[], Any], device: str) -> tuple[Any, float]:
    """make()'s value and its seconds, the device synchronised (bench.common.timed)."""
    value = []
    seconds = timed(lambda: value.append(make()), device)
    return value[0], seconds


def free(device: str) -> None:
    """Return the memory of what was dropped (pipelines hold cycles) to the device."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


class Bench:
    """One run: the bf16 transformer and its schedulers, each size's bf16 forward, the records made so far."""

    def __init__(self, parts: dict, args, device: str, model_dir: str) -> None:
        self.parts, self.args, self.device, self.model_dir = parts, args, device, model_dir
        self.transformer = parts["transformer"]
        self.sizes = [Size.parse(s) for s in args.sizes.split(",")]
        self.references: dict[Size, Reference] = {}
        self.bf16: dict[Size, Timing] = {}
        self.records: list[Record] = []

    def workload(self, size: Size, model: torch.nn.Module) -> Workload:
        return Workload(size, {**self.parts, "transformer": model}, self.args, self.device)

    def reference(self, size: Size) -> Reference:
        workload = self.workload(size, self.transformer)
        inputs = capture_forward(self.transformer, lambda: workload.run_baseline(steps=2))
        return Reference(inputs, forward_output(self.transformer, inputs))

    def run_bf16(self, built_s: float) -> None:
        self.references = {size: self.reference(size) for size in self.sizes}
        self.measure("bf16", self.transformer, Made(built_s, weight_gib(self.transformer)))

    def run_gguf(self, kind: str) -> None:
        restart_host_peak()
        path = Path(self.args.dir) / f"transformer-{kind}.gguf"
        state = self.transformer.state_dict()
        wrote = timed(lambda: stream_gguf(state, path, kind), self.device)
        size = path.stat().st_size
        log(f"{kind}: wrote {path}, {size / 1e9:.2f} GB, in {wrote:.1f} s")
        try:
            model, seconds = timed_value(lambda: self.load(path), self.device)
        finally:
            path.unlink()
        log(f"{kind}: checked, loaded and moved to {self.device} in {seconds:.1f} s; {path} deleted")
        self.measure(kind, model, Made(seconds, weight_gib(model), size / 2**30))
        del model
        free(self.device)

    def load(self, path: Path) -> torch.nn.Module:
        """The GGUF as the DiT loads a transformer_file: refused first if it could not serve, then on the device."""
        checkpoints.check(path, self.model_dir)
        return checkpoints.load(path, self.model_dir, getattr(torch, self.args.dtype)).to(self.device)

    def run_fp8(self) -> None:
        restart_host_peak()
        seconds = timed(lambda: fastpath.quantize_fp8(self.transformer), self.device)
        free(self.device)  # the bf16 weights it replaced
        self.measure("fp8", self.transformer, Made(seconds, weight_gib(self.transformer)))

    def measure(self, kind: str, model: torch.nn.Module, made: Made) -> None:
        log(f"{kind}: {made.weights_gib:.2f} GiB of weights on {self.device}, there in {made.seconds:.1f} s")
        steps = [self.step(kind, model, size) for size in self.sizes]
        host = host_peak_gib()
        log(f"{kind}: peak host resident size {host:.1f} GiB")
        records = [self.record(kind, step, made, host) for step in steps]
        if self.args.write:  # as each format ends: a run cut short by a device's time limit keeps what it measured
            update_results(records, self.args.results, self.args.markdown)
        self.records += records

    def step(self, kind: str, model: torch.nn.Module, size: Size) -> Step:
        workload = self.workload(size, model)
        cuda = self.device.startswith("cuda")
        besides = (torch.cuda.memory_allocated() / 2**30 - weight_gib(model)) if cuda else 0.0
        timing = workload.seconds_per_step(workload.run_baseline)
        if kind == "bf16":
            self.bf16[size] = timing
        reference = self.references[size]
        error = None if kind == "bf16" else rel_l2(forward_output(model, reference.inputs), reference.output)
        step = Step(size, timing, round(timing.peak_gib - besides, 2), error)
        log(
            f"{kind} {size}: {timing.per_step:.4f} s/step ({self.bf16[size].per_step / timing.per_step:.3f}x bf16), "
            f"peak {step.peak_gib:.2f} GiB ({timing.peak_gib:.2f} allocated, {besides:.2f} of it held besides), "
            f"error vs bf16 {'-' if error is None else f'{error:.2e}'}"
        )
        return step

    def record(self, kind: str, step: Step, made: Made, host_gib: float) -> Record:
        base = self.bf16[step.size].per_step
        return Record(
            name=f"dit_step_weights_{step.size}",
            device=device_label(self.device),
            world_size=1,
            dtype=self.args.dtype,
            seconds=step.timing.per_step,
            baseline_seconds=base,
            ratio=base / step.timing.per_step,
            peak_gib=step.peak_gib,
            command=self.args.command,
            date=datetime.date.today().isoformat(),
            variant=VARIANTS[kind],
            baseline=BASELINE,
            software=software(),
            rel_err_bf16=step.error,
            weights_gib=made.weights_gib,
            load_seconds=made.seconds,
            host_hwm_gib=host_gib,
            file_gib=made.file_gib,
        )


def parse_weights(text: str) -> list[str]:
    """The formats to measure, in the order they must run (bf16 always)."""
    asked = set(text.split(","))
    unknown = asked - set(KINDS)
    if unknown:
        raise SystemExit(f"--weights: unknown {sorted(unknown)} (known: {', '.join(KINDS)})")
    return [kind for kind in KINDS if kind in asked or kind == "bf16"]


def run(args, device: str) -> list[Record]:
    kinds = parse_weights(args.weights)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    log(f"building the transformer ({args.dtype}) on {device}")
    parts, built_s = timed_value(lambda: components(args.quick, device, getattr(torch, args.dtype)), device)
    with tempfile.TemporaryDirectory() as model_dir:  # the config checkpoints.load reads: the built transformer's
        parts["transformer"].save_config(str(checkpoints.config_folder(model_dir)))
        bench = Bench(parts, args, device, model_dir)
        bench.run_bf16(built_s)
        for kind in (k for k in kinds if k in GGUF_KINDS):
            bench.run_gguf(kind)
    if "fp8" in kinds:
        if device.startswith("cuda"):
            bench.run_fp8()
        else:
            log("fp8: skipped: torchao's fp8 needs a CUDA GPU (compute capability 8.9 or later)")
    return bench.records


def print_table(records: list[Record]) -> None:
    print(
        f"{'weights':8} {'measurement':30} {'s/step':>8} {'bf16 s':>8} {'ratio':>6} {'peak GiB':>8} "
        f"{'weights GiB':>11} {'load s':>7} {'host GiB':>8} {'file GiB':>8} {'err vs bf16':>11}"
    )
    for r in records:
        file = "" if r.file_gib is None else f"{r.file_gib:.2f}"
        error = "-" if r.rel_err_bf16 is None else f"{r.rel_err_bf16:.2e}"
        print(
            f"{r.variant.split(':')[0]:8} {r.name:30} {r.seconds:8.4f} {r.baseline_seconds:8.4f} {r.ratio:6.3f} "
            f"{r.peak_gib:8.2f} {r.weights_gib:11.3f} {r.load_seconds:7.1f} {r.host_hwm_gib:8.2f} {file:>8} {error:>11}"
        )


def main(argv: list[str] | None = None) -> list[Record]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny preset on CPU: a smoke test of the harness")
    p.add_argument("--sizes", default="480x832x124,768x1344x124")
    p.add_argument("--weights", default=",".join(KINDS), help=f"formats to measure, of {', '.join(KINDS)}")
    p.add_argument(
        "--dir", required=True, help="where each GGUF is written, then deleted once loaded: room for 35 GB (Q8_0)"
    )
    p.add_argument("--forwards", type=int, default=1, help="transformer forwards per timed call")
    p.add_argument("--repeats", type=int, default=2, help="timed calls after the warm-up, per size and format")
    add_output_arguments(p)
    args = p.parse_args(argv)
    args.command = command_line("bench.gguf_step", argv)
    args.dtype = "bfloat16"
    if args.quick:
        args.sizes, args.dtype = "32x64x124", "float32"
    records = run(args, "cpu" if args.quick else "cuda")
    print_table(records)
    return records


if __name__ == "__main__":
    main()
