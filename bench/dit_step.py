"""DiT step time: diffusers' in-process core denoise step vs the DiT service's runner.

Both run in one process, on the same transformer (full released size, random weights built
directly on the GPU; `--quick`: the tiny preset on CPU), the same inputs and the same seed,
alternating so drift hits both alike. A "step" is one transformer forward plus the scheduler
updates; each timed call runs `--forwards` of them and includes the layout and noise set-up,
exactly what a request pays. Prints a table; with --write, updates bench/results.json and
BENCHMARKS.md.

    python -m bench.dit_step --sizes 768x1344x124,480x832x124 --write     # on a GPU
    python -m bench.dit_step --quick                                        # CPU smoke test
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

from bench.results import Record, update_results
from services.dit.runner import DenoiseJob, DenoiseRunner

TEXT_TOKENS = 256
os.environ.setdefault("TQDM_DISABLE", "1")  # diffusers' loop bar would be timed on one side only


@dataclass(frozen=True)
class Size:
    height: int
    width: int
    frames: int

    @classmethod
    def parse(cls, text: str) -> "Size":
        height, width, frames = (int(v) for v in text.split("x"))
        return cls(height, width, frames)

    def __str__(self) -> str:
        return f"{self.height}x{self.width}x{self.frames}"


def full_size_transformer(device: str, dtype: torch.dtype, config: dict | None = None):
    """The released transformer config (or `config`) with random weights, built in place on `device`."""
    from diffusers import MiniMaxH3Transformer3DModel

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = MiniMaxH3Transformer3DModel(**(config or {})).eval()
    finally:
        torch.set_default_dtype(previous)
    for name in model._keep_in_fp32_modules:  # as from_pretrained keeps them
        for module_name, module in model.named_modules():
            if module_name.split(".")[-1] == name or module_name == name:
                module.float()
    return model


def components(quick: bool, device: str, dtype: torch.dtype) -> dict:
    from diffusers.schedulers import MiniMaxH3Scheduler

    if quick:
        from services.common.tiny import build_component

        transformer = build_component("transformer")
    else:
        transformer = full_size_transformer(device, dtype)
    return {"transformer": transformer, "scheduler": MiniMaxH3Scheduler(shift=12.0),
            "audio_scheduler": MiniMaxH3Scheduler(shift=3.0)}


def baseline_pipeline(parts: dict):
    from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3CoreDenoiseStep

    pipe = MiniMaxH3CoreDenoiseStep().init_pipeline()
    pipe.update_components(**parts)
    return pipe


def timed(fn, device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - started


def measure(size: Size, parts: dict, args, device: str) -> Record:
    text_dim = parts["transformer"].config.text_dim
    embeds = torch.randn(1, TEXT_TOKENS, text_dim, generator=torch.Generator().manual_seed(0)).to(
        device, parts["transformer"].dtype)
    tags = torch.ones(TEXT_TOKENS, dtype=torch.int64)  # the layout is built on the CPU
    job = DenoiseJob(size.height, size.width, size.frames, args.forwards + 1, seed=0)
    baseline, ours = baseline_pipeline(parts), DenoiseRunner(parts)

    def run_baseline():
        baseline(prompt_embeds=embeds, text_token_tags=tags, height=size.height, width=size.width,
                 num_frames=size.frames, num_inference_steps=job.num_inference_steps,
                 generator=torch.Generator().manual_seed(0), output=["latents", "audio_latents"])

    def run_ours():
        ours.run(job, embeds, tags, lambda step, total: None)

    with torch.no_grad():
        run_baseline(), run_ours()  # warm-up: kernels, allocator, autotuning
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        times = {"baseline": [], "ours": []}
        for _ in range(args.repeats):
            times["baseline"].append(timed(run_baseline, device) / args.forwards)
            times["ours"].append(timed(run_ours, device) / args.forwards)
    seconds, baseline_seconds = statistics.median(times["ours"]), statistics.median(times["baseline"])
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else 0.0
    return Record(
        name=f"dit_step_{size}", device=device_label(device), world_size=1, dtype=str(args.dtype),
        seconds=seconds, baseline_seconds=baseline_seconds, ratio=baseline_seconds / seconds,
        peak_gib=round(peak, 2), command=args.command,
        date=datetime.date.today().isoformat(), variant="service runner (diffusers native attention)",
        baseline="diffusers MiniMaxH3CoreDenoiseStep, in process", software=software())


def device_label(device: str) -> str:
    if device.startswith("cuda"):
        return f"1x{torch.cuda.get_device_name().replace('NVIDIA ', '')}"
    return "cpu"


def software() -> str:
    import diffusers

    cuda = f", CUDA {torch.version.cuda}" if torch.cuda.is_available() else ""
    return f"torch {torch.__version__}, diffusers {diffusers.__version__}{cuda}"


def main(argv: list[str] | None = None) -> list[Record]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny preset on CPU: a smoke test of the harness")
    p.add_argument("--sizes", default="768x1344x124,480x832x124")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--forwards", type=int, default=2, help="transformer forwards per timed call")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--write", action="store_true", help="update bench/results.json and BENCHMARKS.md")
    p.add_argument("--results", default="bench/results.json")
    p.add_argument("--markdown", default="BENCHMARKS.md")
    args = p.parse_args(argv)
    args.command = " ".join(["python -m bench.dit_step", *(sys.argv[1:] if argv is None else argv)])
    if args.quick:
        args.sizes, args.dtype = "32x64x124", "float32"
    device = "cpu" if args.quick else "cuda"
    parts = components(args.quick, device, getattr(torch, args.dtype))
    records = [measure(Size.parse(s), parts, args, device) for s in args.sizes.split(",")]
    print(f"{'measurement':28} {'device':10} {'ours s':>9} {'diffusers s':>12} {'ratio':>7} {'peak GiB':>9}")
    for r in records:
        print(f"{r.name:28} {r.device:10} {r.seconds:9.4f} {r.baseline_seconds:12.4f} {r.ratio:7.3f} {r.peak_gib:9.2f}")
    if args.write:
        update_results(records, args.results, args.markdown)
    return records


if __name__ == "__main__":
    main()
