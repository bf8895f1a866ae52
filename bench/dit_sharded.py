"""The sharded DiT group: seconds per denoise step on N GPUs, and its correctness on NCCL.

Launches N ranks itself (torchrun). Every rank builds the transformer with random weights on
its own GPU (`--quick`: the tiny preset on CPU with gloo, 2 ranks), rank 0 first times the
one-GPU service runner (= diffusers' core denoise step, bench/dit_step.py) on the whole model
as the baseline, then the model is prepared exactly as the service prepares it (attention
backend, FSDP2 if `--fsdp on`, Ulysses or ring over all ranks) and timed through the group's
own per-rank loop (`GroupMember.run`, with its per-step stop vote). A step is timed between
consecutive step boundaries with CUDA events, after a warm-up request; peak memory is each
rank's during the timed request.

    python -m bench.dit_sharded --world-size 2 --fsdp off --sizes 768x1344x124 --write
    python -m bench.dit_sharded --world-size 4 --fsdp on --split ring --attention-backend _native_cudnn
    python -m bench.dit_sharded --check --world-size 2            # N ranks vs 1 rank, mid-size model
    python -m bench.dit_sharded --check --world-size 2 --dtype bfloat16 --attention-backend _native_cudnn
    python -m bench.dit_sharded --quick                             # CPU smoke test of the harness

Ring attention needs a backend that returns the log-sum-exp: on GPUs `_native_cudnn` or
`_native_flash` (bf16); `--check` reports the reason for a variant that cannot run.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from bench.common import Size, denoise_spec, leaves_gpu_empty, software
from bench.dit_step import TEXT_TOKENS
from bench.results import Record, add_output_arguments, update_results
from h3serve.model import presets
from h3serve.runtime import random_full
from h3serve.runtime.fastpath import FastPath

MID_SIZE = dict(  # the released structure at a size one GPU runs in seconds: real head dim, real channels
    num_attention_heads=8,
    attention_head_dim=128,
    hidden_size=1024,
    num_layers=4,
    num_refiner_layers=1,
    ffn_dim=4096,
    in_channels=24,
    audio_in_channels=32,
    patch_size=(1, 2, 2),
    text_dim=1024,
    freq_dim=256,
    time_embed_hidden_dim=1024,
    time_embed_dim=512,
    rope_freq_dim=16,
    rope_theta=10000.0,
)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2, help="ranks (GPUs) in the group")
    p.add_argument("--fsdp", choices=["on", "off"], default="off", help="shard the weights with FSDP2")
    p.add_argument("--split", choices=["ulysses", "ring"], default="ulysses", help="how the sequence is split")
    p.add_argument("--sizes", default="768x1344x124")
    p.add_argument("--dtype", default=None, help="default: bfloat16 (timing), float32 (--check, --quick)")
    p.add_argument(
        "--attention-backend",
        default="native",
        help="a diffusers backend name, or a local kernel (flash4, cudnn_fp8: Ulysses only)",
    )
    p.add_argument("--compile", action="store_true", help="regional torch.compile (the fast path) before the split")
    p.add_argument("--fp8", action="store_true", help="fp8 W8A8 block linears (the fast path's opt-in option)")
    p.add_argument("--forwards", type=int, default=4, help="forwards in the timed request (steps timed: one less)")
    p.add_argument("--quick", action="store_true", help="tiny preset, CPU, gloo, 2 ranks: a smoke test")
    p.add_argument("--check", action="store_true", help="latents of N ranks vs 1 rank for every split and FSDP")
    add_output_arguments(p)
    p.add_argument("--out", help=argparse.SUPPRESS)  # set by the launcher: rank 0 writes its rows here
    p.add_argument("--command", default="", help=argparse.SUPPRESS)  # set by the launcher: the command to record
    args = p.parse_args(argv)
    if args.quick:
        args.world_size, args.sizes = 2, "32x64x124"
    args.dtype = args.dtype or ("float32" if args.quick or args.check else "bfloat16")
    args.device = "cpu" if args.quick else "cuda"
    return args


def main(argv: list[str] | None = None) -> list:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if "RANK" in os.environ:  # started by torchrun below
        run_rank(args)
        return []
    rows = launch(args, argv)
    if args.check:
        print_check(rows)
        return rows
    records = [Record(**row) for row in rows]
    print_records(records)
    if args.write:
        update_results(records, args.results, args.markdown)
    return records


def launch(args: argparse.Namespace, argv: list[str]) -> list[dict]:
    from h3serve.services.dit.launch import NCCL_ENV

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={args.world_size}",
            "-m",
            "bench.dit_sharded",
            *argv,
            "--out",
            str(out),
            "--command",
            " ".join(["python -m bench.dit_sharded", *argv]),
        ]
        env = {**NCCL_ENV, **os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        with leaves_gpu_empty():
            subprocess.run(command, check=True, env=env)
        return json.loads(out.read_text())


def run_rank(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    from h3serve.services.dit import parallel
    from h3serve.services.dit.group import ControlPlane

    device = parallel.rank_device(args.device)
    control = ControlPlane(parallel.init_groups(device, timeout_s=3600))
    if args.check:
        rows = check(args, control, device)
    else:
        rows = [asdict(measure(Size.parse(s), args, control, device)) for s in args.sizes.split(",")]
    if control.rank == 0:
        Path(args.out).write_text(json.dumps(rows))
    dist.barrier()  # without it gloo teardown sometimes aborts
    dist.destroy_process_group()


class StepTimer:
    """Marks step boundaries (CUDA events on a GPU) and gives the median time between them."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.marks = device, []

    def mark(self, step: int, total: int) -> None:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def median_seconds(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            gaps = [a.elapsed_time(b) / 1000 for a, b in itertools.pairwise(self.marks)]
        else:
            gaps = [b - a for a, b in itertools.pairwise(self.marks)]
        return statistics.median(gaps)


def components(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, config: dict | None = None):
    from diffusers import MiniMaxH3Transformer3DModel
    from diffusers.schedulers import MiniMaxH3Scheduler

    if args.quick or config is not None:
        sized = functools.partial(MiniMaxH3Transformer3DModel, **(config or presets.TINY_TRANSFORMER))
        skeleton = random_full.skeleton(sized, dtype)  # the same seeded weights on every rank, then moved
        transformer = random_full.materialise(skeleton, "transformer", "cpu").to(device)
    else:  # released size, built on this rank's GPU, seeded alike on every rank
        transformer = random_full.build_component("transformer", str(device), dtype)
    return {
        "transformer": transformer,
        "scheduler": MiniMaxH3Scheduler(shift=12.0),
        "audio_scheduler": MiniMaxH3Scheduler(shift=3.0),
    }


def job_message(size: Size, forwards: int, text_dim: int):
    from h3serve.services.dit.group import JOB, Message

    embeds = torch.randn(1, TEXT_TOKENS, text_dim, generator=torch.Generator().manual_seed(0))
    tensors = {"prompt_embeds": embeds, "text_token_tags": torch.ones(TEXT_TOKENS, dtype=torch.int64)}
    return Message(JOB, denoise_spec(size, forwards), tensors)


def layout_of(args: argparse.Namespace, split: str | None = None, fsdp: bool | None = None):
    from h3serve.services.dit.parallel import Layout

    split, fsdp = split or args.split, args.fsdp == "on" if fsdp is None else fsdp
    n = args.world_size
    return Layout(n, n if split == "ulysses" else 1, n if split == "ring" else 1, fsdp and n > 1)


def timed_steps(run, device: torch.device, message, warm_message) -> tuple[float, object]:
    """Warm up (kernels, allocator, autotuning), then time one request step by step."""
    from h3serve.services.dit import parallel

    run(warm_message, lambda step, total: None)
    timer = StepTimer(device)
    parallel.reset_peak_memory(device)
    result = run(message, timer.mark)
    return timer.median_seconds(), result


def measure(size: Size, args: argparse.Namespace, control, device: torch.device) -> Record:
    from h3serve.services.dit import parallel
    from h3serve.services.dit.group import GroupMember
    from h3serve.services.dit.runner import DenoiseRunner, served

    dtype = getattr(torch, args.dtype)
    parts = components(args, device, dtype)
    fast = FastPath(attention=args.attention_backend, compile=args.compile, fp8=args.fp8)
    # the baseline runs on it too (compiled as the group will need it: around the all-to-alls)
    parallel.ready_model(parts["transformer"], fast, device, dtype, sequence_split=args.world_size > 1)
    text_dim = parts["transformer"].config.text_dim
    message, warm = job_message(size, args.forwards, text_dim), job_message(size, 2, text_dim)
    baseline = 0.0
    if control.rank == 0:  # one GPU, whole model, the service's runner (= diffusers, bench/dit_step)
        runner = DenoiseRunner(parts, served(["t2va"]))
        baseline, _ = timed_steps(lambda m, obs: runner.run(m.spec, *m.tensors.values(), obs), device, message, warm)
    control.any(False)  # the other ranks wait here for the baseline
    layout = layout_of(args)
    parallel.parallelize(parts["transformer"], layout, device)
    member = GroupMember(
        control, DenoiseRunner(parts, served(["t2va"])), device, args.attention_backend, max_math_tokens=4096
    )

    def group_run(m, observe):
        outcome = member.run(m, observe, lambda: False)
        if outcome.invalid is not None:  # raised alike on every rank
            raise RuntimeError(f"the group cannot run {layout.split} here: {outcome.invalid}")
        return outcome

    seconds, outcome = timed_steps(group_run, device, message, warm)
    peaks = [round(r.peak_bytes / 2**30, 2) for r in outcome.ranks]
    split = "1 rank" if layout.world_size == 1 else f"{layout.split}, {'FSDP2' if layout.fsdp else 'replicated'}"
    return Record(
        name=f"dit_sharded_{size}",
        device=device_label(device, layout.world_size),
        world_size=layout.world_size,
        dtype=args.dtype,
        seconds=seconds,
        baseline_seconds=baseline,
        ratio=baseline / seconds,
        peak_gib=max(peaks),
        rank_peaks_gib=peaks,
        command=args.command,
        date=datetime.date.today().isoformat(),
        variant=f"group: {split}, {fast.describe()}",
        baseline="service runner on 1 GPU, whole model (= diffusers core denoise step)",
        software=software(),
    )


def check(args: argparse.Namespace, control, device: torch.device) -> list[dict]:
    """Latents after a short request: N ranks for each split and FSDP setting vs 1 rank, same weights."""
    from h3serve.services.dit import parallel
    from h3serve.services.dit.group import GroupMember
    from h3serve.services.dit.runner import DenoiseRunner, served

    dtype, config = getattr(torch, args.dtype), presets.TINY_TRANSFORMER if args.quick else MID_SIZE
    size = Size.parse(args.sizes if args.quick else "480x832x124")
    message = job_message(size, 2, config["text_dim"])
    reference = None
    if control.rank == 0:
        reference = DenoiseRunner(components(args, device, dtype, config), served(["t2va"])).run(
            message.spec, *message.tensors.values(), lambda step, total: None
        )
    rows = []
    for split in ("ulysses", "ring"):
        for fsdp in (False, True):
            layout = layout_of(args, split, fsdp)
            parts = components(args, device, dtype, config)
            parallel.prepare_transformer(parts["transformer"], layout, FastPath(args.attention_backend), device, dtype)
            member = GroupMember(control, DenoiseRunner(parts, served(["t2va"])), device, args.attention_backend, 4096)
            outcome = member.run(message, lambda step, total: None, lambda: False)
            row = {
                "variant": f"{layout.split}, {'FSDP2' if fsdp else 'replicated'}",
                "size": str(size),
                "dtype": args.dtype,
                "backend": args.attention_backend,
            }
            if outcome.invalid is not None:
                row["error"] = str(outcome.invalid)
            elif reference is not None:
                row.update(differences(outcome.latents, reference))
            rows.append(row)
    return rows


def differences(got: dict, want: dict) -> dict:
    out = {}
    for name in ("latents", "audio_latents"):
        diff = (got[name] - want[name]).abs().max().item()
        out[f"{name}_max_abs"], out[f"{name}_max_rel"] = diff, diff / want[name].abs().max().item()
    return out


def device_label(device: torch.device, world_size: int) -> str:
    if device.type == "cuda":
        return f"{world_size}x{torch.cuda.get_device_name(device).replace('NVIDIA ', '')}"
    return f"{world_size}xcpu"


def print_records(records: list[Record]) -> None:
    print(f"{'measurement':26} {'device':10} {'variant':50} {'s/step':>8} {'1-GPU s':>8} {'x':>6}  peak GiB/rank")
    for r in records:
        print(
            f"{r.name:26} {r.device:10} {r.variant:50} {r.seconds:8.4f} {r.baseline_seconds:8.4f} "
            f"{r.ratio:6.3f}  {r.rank_peaks_gib}"
        )


def print_check(rows: list[dict]) -> None:
    for row in rows:
        numbers = row.get("error") or "  ".join(f"{k} {v:.3e}" for k, v in row.items() if k.endswith(("abs", "rel")))
        print(f"{row['variant']:24} {row['size']:12} {row['dtype']:9} {row['backend']:14} {numbers}")


if __name__ == "__main__":
    main()
