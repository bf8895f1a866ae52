"""LoRA adapters on the DiT: s/step with an adapter against the same DiT without one, and the swap time.

Full released size, random weights built on the GPU (`--quick`: the tiny preset on CPU), two random LoRA files
of `--rank` on every linear layer of every transformer block (diffusers' layout), loaded the way the service
loads them (h3serve/services/dit/adapters.py) into the service's runner. Each phase builds a fresh transformer,
since compile and fp8 cannot be undone in place:

- eager: adapters resident (peft's own switch); the request with adapter `a`, and with none (LoRA off);
- every phase with adapters: their load (read, checked, installed), as a start spends it;
- `+compile` (and `+fp8`): first the DiT with no adapters configured (the base), then a fresh one with adapter
  slots (switching writes the slot's weights and scale, so nothing recompiles): a request with `a`, one with none
  (an empty slot still runs its matmuls), the swap a -> b (the weight copy, timed alone) and the compiled graphs
  counted before and after the swaps (dynamo's unique_graphs: 0 new means no recompile).

The ratio column is base s/step / adapter s/step (1.0: free; the issue's target is the adapter within 1.05x).

    python -m bench.adapters --sizes 480x832x124 --attention _native_cudnn --phases eager,compile,compile+fp8 --write
    python -m bench.adapters --quick
"""

from __future__ import annotations

import argparse
import datetime
import gc
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.common import Size, denoise_spec, device_label, software, timed
from bench.dit_step import TEXT_TOKENS, components
from bench.results import Record, add_output_arguments, command_line, update_results
from h3serve.common.config import DiTConfig
from h3serve.runtime import fastpath
from h3serve.runtime.fastpath import FastPath
from h3serve.services.dit import adapters
from h3serve.services.dit.runner import DenoiseRunner, served
from h3serve.v1 import common_pb2


def lora_targets(transformer: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    """The linears the bench's LoRA adapts: every one in the transformer blocks."""
    return [
        (name, module)
        for name, module in transformer.named_modules()
        if name.startswith("transformer_blocks.") and isinstance(module, torch.nn.Linear)
    ]


def write_lora(transformer: torch.nn.Module, path: Path, rank: int, seed: int) -> Path:
    """A random LoRA of `rank` on every linear layer of the transformer blocks, small next to the weights."""
    generator = torch.Generator().manual_seed(seed)
    factors = {}
    for name, module in lora_targets(transformer):
        down = torch.randn(rank, module.in_features, generator=generator) / module.in_features**0.5
        up = torch.randn(module.out_features, rank, generator=generator) * 0.01 / rank**0.5
        factors[f"transformer.{name}.lora_A.weight"] = down.to(torch.bfloat16).contiguous()
        factors[f"transformer.{name}.lora_B.weight"] = up.to(torch.bfloat16).contiguous()
    save_file(factors, str(path))
    return path


class Phase:
    """One fresh transformer, readied as the service readies it, with or without adapters."""

    def __init__(self, args, device: str, fast: FastPath, files: dict[str, Path] | None) -> None:
        self.args, self.device = args, device
        parts = components(args.quick, device, getattr(torch, args.dtype))
        transformer = parts["transformer"]
        config = DiTConfig(
            compile=fast.compile, adapters={k: str(v) for k, v in (files or {}).items()}, adapter_slots=1
        )
        started = time.perf_counter()
        self.held = adapters.install(config, {"transformer": transformer})  # before the fast path, as rank.py
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        self.load_s = time.perf_counter() - started  # read, checked and installed: what a start spends on them
        fastpath.apply(transformer, fast)
        self.runner = DenoiseRunner(parts, served(["t2va"]), self.held)
        self.embeds = torch.randn(
            1, TEXT_TOKENS, transformer.config.text_dim, generator=torch.Generator().manual_seed(0)
        ).to(device, transformer.dtype)
        self.tags = torch.ones(TEXT_TOKENS, dtype=torch.int64)

    def request(self, size: Size, names: list[str]):
        spec = denoise_spec(size, self.args.forwards)
        spec.params.adapters.extend(common_pb2.Adapter(name=n, weight=1.0) for n in names)
        return lambda: self.runner.run(spec, self.embeds, self.tags, lambda step, total: None)

    def seconds_per_step(self, size: Size, names: list[str]) -> float:
        """Median s/step after one warm-up request of the same shape and adapters (compile, kernels)."""
        run = self.request(size, names)
        with torch.no_grad():
            run()
            times = sorted(timed(run, self.device) / self.args.forwards for _ in range(self.args.repeats))
        return times[len(times) // 2]

    def swap_seconds(self, size: Size) -> tuple[float, int]:
        """The a -> b -> a switch, timed alone (median over both), and the graphs compiled meanwhile."""
        from torch._dynamo.utils import counters

        graphs = counters["stats"]["unique_graphs"]
        switches = []
        for names in (["b"], ["a"], ["b"]):
            started = time.perf_counter()
            self.held.apply("transformer", [common_pb2.Adapter(name=n, weight=1.0) for n in names])
            if self.device.startswith("cuda"):
                torch.cuda.synchronize()
            switches.append(time.perf_counter() - started)
            with torch.no_grad():
                self.request(size, names)()  # a request after each switch: a recompile would show here
        return sorted(switches)[1], counters["stats"]["unique_graphs"] - graphs

    def close(self) -> None:
        del self.runner, self.held
        gc.collect()
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()


def record(size: Size, variant: str, seconds: float, base: float, args, device: str, **extra) -> Record:
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else 0.0
    return Record(
        name=f"dit_adapter_{size}",
        device=device_label(device),
        world_size=1,
        dtype=args.dtype,
        seconds=seconds,
        baseline_seconds=base,
        ratio=base / seconds,
        peak_gib=round(peak, 2),
        command=args.command,
        date=datetime.date.today().isoformat(),
        variant=variant,
        baseline="the same service DiT without adapters (same fast path, same run)",
        software=software(),
        **extra,
    )


def run_phase(name: str, size: Size, files: dict[str, Path], args, device: str) -> list[Record]:
    flags = set(name.split("+")) - {"eager"}
    unknown = flags - set(fastpath.FLAGS)
    if unknown:
        raise SystemExit(f"--phases: unknown {sorted(unknown)} in {name!r} (eager, or {', '.join(fastpath.FLAGS)})")
    fast = FastPath(attention=args.attention, **{flag: flag in flags for flag in fastpath.FLAGS})
    base = Phase(args, device, fast, None)
    base_s = base.seconds_per_step(size, [])
    base.close()
    print(f"  {name}: base {base_s:.4f} s/step", flush=True)
    phase = Phase(args, device, fast, files)
    holder = "slots" if fast.compile else "resident"
    with_a = phase.seconds_per_step(size, ["a"])
    without = phase.seconds_per_step(size, [])
    load = f"{fast.describe()}, load of {len(files)} adapters (rank {args.rank}, {holder})"
    records = [
        record(size, f"{fast.describe()}, adapter a (rank {args.rank}, {holder})", with_a, base_s, args, device),
        record(size, f"{fast.describe()}, adapters loaded, none named ({holder})", without, base_s, args, device),
        record(size, load, phase.load_s, phase.load_s, args, device),
    ]
    line = f"  {name}: load {phase.load_s:.2f} s, adapter {with_a:.4f}, none named {without:.4f} s/step"
    if fast.compile:
        swap, graphs = phase.swap_seconds(size)
        records.append(
            record(size, f"{fast.describe()}, swap a<->b ({holder}); new graphs: {graphs}", swap, swap, args, device)
        )
        line += f", swap {swap:.3f} s, {graphs} new graphs"
    print(line, flush=True)
    phase.close()
    return records


def main(argv: list[str] | None = None) -> list[Record]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny preset on CPU: a smoke test of the harness")
    p.add_argument("--sizes", default="480x832x124")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--attention", default="_native_cudnn", help="the attention backend of every phase")
    p.add_argument("--phases", default="eager,compile", help="eager, compile, compile+fp8 (comma-separated)")
    p.add_argument("--rank", type=int, default=128)
    p.add_argument("--forwards", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    add_output_arguments(p)
    args = p.parse_args(argv)
    args.command = command_line("bench.adapters", argv)
    if args.quick:
        args.sizes, args.dtype, args.attention, args.rank = "32x64x124", "float32", "native", 4
    device = "cpu" if args.quick else "cuda"
    with tempfile.TemporaryDirectory() as folder:
        model = components(args.quick, "cpu" if args.quick else "meta", getattr(torch, args.dtype))["transformer"]
        files = {
            name: write_lora(model, Path(folder) / f"{name}.safetensors", args.rank, seed)
            for seed, name in enumerate(("a", "b"))
        }
        del model
        records = [
            r
            for size in (Size.parse(s) for s in args.sizes.split(","))
            for name in args.phases.split(",")
            for r in run_phase(name, size, files, args, device)
        ]
    print(f"{'measurement':26} {'variant':70} {'s':>8} {'base s':>8} {'ratio':>6}")
    for r in records:
        print(f"{r.name:26} {r.variant:70} {r.seconds:8.4f} {r.baseline_seconds:8.4f} {r.ratio:6.3f}")
    if args.write:
        update_results(records, args.results, args.markdown)
    return records


if __name__ == "__main__":
    main()
