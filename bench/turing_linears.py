"""The DiT's linears for sm_75, on one lent GPU: fp16_scaled (and int8 weights) against bf16, and overflow.

`[dit] linear_precision = "fp16_scaled"` runs the linears on fp16 tensor cores with an fp32 residual stream
(h3serve/runtime/fp16_linears.py); `weights = "int8"` holds the block linears in int8, widened to fp16 as each runs
(h3serve/runtime/int8_weights.py). On the full-size transformer with random weights (random:full), this bench:

1. runs one forward at `--size` (480x832x124: the 4 x 2080 Ti profile's canvas) in bf16, then the same inputs with
   the model converted to fp16_scaled, then (rebuilt) with int8 weights: each output's relative L2 distance to the
   bf16 output, whether every value is finite, the forward's seconds and peak GPU memory;
2. drives a rebuilt bf16 model's activations to the maxima the minimax-h3-fp16-fix report measured on the released
   model (bench/overflow.py: residual 4.3M, attn.to_out.0 / ff.net.2 past 2M, context input ~96k) at the small
   `--drive-size`, shows that block 0 in plain fp16 overflows there, and runs the driven model in fp16_scaled
   (finite; distance to the driven bf16 output).

Times are the lent card's (an H100 or H200 runs the bf16 GEMMs on tensor cores, which a 2080 Ti cannot): they are no
Turing figure. The host memory of this process (sampled) is recorded too. Needs one GPU with ~76 GiB (the fp16 weights
are as large as the bf16 ones; the fp32 stream's activations at 480x832x124 come on top). Prints a table; `--write`
updates bench/results.json and BENCHMARKS.md; with $OUT set, writes turing_linears.json there.

    python -m bench.turing_linears --write                 # one H100 / H200, ~3 minutes
    python -m bench.turing_linears --quick                 # the tiny model on the CPU (a smoke test)
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench import overflow
from bench.accuracy import rel_l2
from bench.common import Size, denoise_spec, device_label, host_peak, software
from bench.results import Record, add_output_arguments, command_line, update_results
from h3serve.runtime import fastpath, random_full
from h3serve.runtime.fastpath import FastPath
from h3serve.services.dit.runner import DenoiseRunner, served

TEXT_TOKENS = 256
RANK_BLOCKS = 13  # one rank of four holds a quarter of the 50 blocks' rows: as much as 12.5 whole blocks
RANK_SHARE = "--rank-share"  # the child of step 3
FP16_RESIDUAL = 3e4  # block 0's residual input brought within fp16's range, to see its branches overflow alone
VARIANTS = {
    "fp16_scaled": FastPath(linears="fp16_scaled"),
    "fp16_scaled+int8": FastPath(linears="fp16_scaled", weights="int8"),
}
PIPELINE_LOG = "diffusers.modular_pipelines.modular_pipeline"  # logs the stopped forward as an error: quieted


class _Captured(Exception):
    """Raised by `capture` once the forward's inputs are held: the forward itself is not run."""


def as_bf16(transformer: torch.nn.Module) -> torch.nn.Module:
    """An fp32 transformer as a bf16 checkpoint loads: its fp32-pinned modules stay fp32."""
    model = copy.deepcopy(transformer).to(torch.bfloat16)
    for name in model._keep_in_fp32_modules:
        getattr(model, name).float()
    return model


def build(quick: bool, device: str) -> torch.nn.Module:
    """The bf16 transformer: the released sizes with random:full's seeded values, or (`quick`) the tiny preset."""
    if quick:
        from h3serve.runtime.tiny import build_component

        return as_bf16(build_component("transformer"))
    return random_full.build_component("transformer", device, torch.bfloat16)


def capture(transformer: torch.nn.Module, size: Size, device: str) -> dict:
    """The keyword inputs of the service runner's first forward of a t2va request at `size` (not run)."""
    from diffusers.schedulers import MiniMaxH3Scheduler

    parts = {
        "transformer": transformer,
        "scheduler": MiniMaxH3Scheduler(shift=12.0),
        "audio_scheduler": MiniMaxH3Scheduler(shift=3.0),
    }
    embeds = torch.randn(1, TEXT_TOKENS, transformer.config.text_dim, generator=torch.Generator().manual_seed(0))
    captured: dict = {}

    def hook(_module, args, kwargs):
        captured.update(dict(zip(("hidden_states",), args, strict=False)), **kwargs)
        raise _Captured

    handle = transformer.register_forward_pre_hook(hook, with_kwargs=True)
    pipeline_log = logging.getLogger(PIPELINE_LOG)
    level, pipeline_log.level = pipeline_log.level, logging.CRITICAL
    try:
        DenoiseRunner(parts, served(["t2va"]), device=torch.device(device)).run(
            denoise_spec(size, forwards=1),
            embeds.to(device, torch.bfloat16),
            torch.ones(TEXT_TOKENS, dtype=torch.int64),
            lambda step, total: None,
        )
    except _Captured:
        pass
    finally:
        handle.remove()
        pipeline_log.setLevel(level)
    return {name: value for name, value in captured.items() if name != "return_dict"}


@dataclass
class Forward:
    output: torch.Tensor  # video and audio outputs, flattened, fp32 on the CPU
    seconds: float
    peak_gib: float

    @property
    def finite(self) -> bool:
        return bool(self.output.isfinite().all())


def forward(transformer: torch.nn.Module, inputs: dict, device: str) -> Forward:
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    with torch.no_grad():
        video, audio = transformer(**inputs, return_dict=False)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    return Forward(torch.cat([video.float().flatten().cpu(), audio.float().flatten().cpu()]), seconds, round(peak, 2))


def release(device: str) -> None:
    """Give back what the last model held: it sits in reference cycles (the capture's traceback, module hooks) that
    only the cyclic collector frees, and the next full-size model needs the card's memory."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


@dataclass
class Comparison:
    variant: str
    seconds: float
    bf16_seconds: float
    peak_gib: float
    rel_l2_vs_bf16: float
    finite: bool


def compare(args, size: Size, device: str) -> list[Comparison]:
    """Step 1: bf16, then each variant on a model built afresh (the same seeded values), on the same inputs."""
    results = []
    transformer = build(args.quick, device)
    inputs = capture(transformer, size, device)
    print(f"[turing_linears] {size}: {inputs['position_ids'].shape[0]} packed rows; bf16 forward ...", flush=True)
    reference = forward(transformer, inputs, device)
    print(f"[turing_linears]   bf16: {reference.seconds:.2f} s, peak {reference.peak_gib} GiB", flush=True)
    for name, fast in VARIANTS.items():
        if transformer is None:
            transformer = build(args.quick, device)
        fastpath.convert_linears(transformer, fast)
        release(device)
        print(f"[turing_linears]   {name} forward ...", flush=True)
        out = forward(transformer, inputs, device)
        results.append(
            Comparison(
                name, out.seconds, reference.seconds, out.peak_gib, rel_l2(out.output, reference.output), out.finite
            )
        )
        print(f"[turing_linears]   {name}: {asdict(results[-1])}", flush=True)
        transformer = None
        release(device)
    return results


@dataclass
class Driven:
    maxima: dict[str, float]  # what the driven bf16 forward reached (bench/overflow.py)
    reached: bool
    plain_fp16_block_finite: bool  # block 0 in plain fp16 on its driven inputs
    plain_fp16_branch_finite: bool  # the same with its residual input brought within fp16's range (the branches)
    scaled_finite: bool
    rel_l2_vs_bf16: float  # the driven model in fp16_scaled against the driven model in bf16
    seconds: float
    bf16_seconds: float


def driven(args, size: Size, device: str) -> Driven:
    """Step 2: a bf16 model driven to the reported maxima, block 0 in plain fp16, then the model in fp16_scaled."""
    transformer = build(args.quick, device)
    inputs = overflow.drive_inputs(transformer, capture(transformer, size, device))
    print(f"[turing_linears] driving to the reported maxima at {size} ...", flush=True)
    maxima = overflow.drive(transformer, lambda: forward(transformer, inputs, device))
    block_inputs: dict = {}

    def keep(_module, block_args, block_kwargs):
        block_inputs.update(args=block_args, kwargs=block_kwargs)

    handle = transformer.transformer_blocks[0].register_forward_pre_hook(keep, with_kwargs=True)
    reference = forward(transformer, inputs, device)
    handle.remove()
    plain = copy.deepcopy(transformer.transformer_blocks[0]).half()
    hidden, *rest = block_inputs["args"]
    within = hidden * (FP16_RESIDUAL / hidden.float().abs().max())  # the norms make the branches see the same rows
    with torch.no_grad():
        block_finite, branch_finite = (
            bool(plain(h.half(), *rest, **block_inputs["kwargs"]).isfinite().all()) for h in (hidden, within)
        )
    del plain, hidden, within, rest
    fastpath.convert_linears(transformer, VARIANTS["fp16_scaled"])
    release(device)
    out = forward(transformer, inputs, device)
    return Driven(
        maxima,
        overflow.reached(maxima),
        block_finite,
        branch_finite,
        out.finite,
        rel_l2(out.output, reference.output),
        out.seconds,
        reference.seconds,
    )


def rank_share(quick: bool, device: str) -> dict:
    """Step 3's child: RANK_BLOCKS blocks (the tiny preset's with `quick`) converted to int8 on the meta device and
    filled on `device` through fp16_linears.ConvertedRows, as parallel.load_sharded fills a rank's rows."""
    from diffusers import MiniMaxH3Transformer3DModel

    from h3serve.model import presets
    from h3serve.runtime.fp16_linears import ConvertedRows
    from h3serve.runtime.sharded_load import RandomWeights, fill_module

    sizes = presets.TINY_TRANSFORMER if quick else {"num_layers": RANK_BLOCKS}
    started = time.perf_counter()
    model = random_full.skeleton(lambda: MiniMaxH3Transformer3DModel(**sizes), torch.bfloat16)
    changed = fastpath.convert_linears(model, VARIANTS["fp16_scaled+int8"])
    fill_module(model, ConvertedRows(RandomWeights("transformer"), changed), "", torch.device(device))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    seconds = round(time.perf_counter() - started, 1)
    return {"blocks": len(model.transformer_blocks), "weights_gib": round(weights, 2), "seconds": seconds}


def rank_share_host(quick: bool) -> dict:
    """Step 3: the child's build, its private host memory sampled from its start (bench/common.py host_peak)."""
    from h3serve.common.memory_plan import PROCESS_BASE_GIB

    command = [sys.executable, "-m", "bench.turing_linears", RANK_SHARE, *(["--quick"] if quick else [])]
    print(f"[turing_linears] one rank's share built in a process of its own: {' '.join(command)}", flush=True)
    children: list[int] = []
    with host_peak(lambda: children) as host:
        child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        children.append(child.pid)
        out, _ = child.communicate(timeout=600)
    if child.returncode != 0:
        raise RuntimeError(f"the rank-share process failed (exit {child.returncode})")
    built = json.loads(out.strip().splitlines()[-1])
    return {**built, "host_private_gib": round(host.private_gib, 2), "planned_runtime_gib": PROCESS_BASE_GIB}


def records(
    size: Size, drive_size: Size, compared: list[Comparison], drove: Driven, share: dict, args, device: str
) -> list[Record]:
    common = dict(
        device=device_label(device),
        world_size=1,
        dtype="bfloat16",
        command=args.command,
        date=datetime.date.today().isoformat(),
        software=software(),
        host_peak_gib=args.host_peak_gib,
    )
    rows = [
        Record(
            name=f"turing_linears_{size}",
            seconds=c.seconds,
            baseline_seconds=c.bf16_seconds,
            ratio=c.bf16_seconds / c.seconds,
            peak_gib=c.peak_gib,
            variant=f"{c.variant} linears, one random-weight forward (finite: {c.finite}; not a Turing time)",
            baseline="bf16 linears, same weights and inputs, same run",
            rel_err_bf16=c.rel_l2_vs_bf16,
            **common,
        )
        for c in compared
    ]
    maxima = ", ".join(f"{kind} {value:.3g}" for kind, value in drove.maxima.items())
    rows.append(
        Record(
            name=f"turing_linears_driven_{drive_size}",
            seconds=drove.seconds,
            baseline_seconds=drove.bf16_seconds,
            ratio=drove.bf16_seconds / drove.seconds,
            peak_gib=0.0,
            variant=f"fp16_scaled, activations driven to max abs {maxima} (reported maxima reached: {drove.reached}); "
            f"finite: {drove.scaled_finite}; block 0 in plain fp16 finite: {drove.plain_fp16_block_finite}, with its "
            f"residual input within fp16: {drove.plain_fp16_branch_finite}",
            baseline="the driven model in bf16, same run",
            rel_err_bf16=drove.rel_l2_vs_bf16,
            **common,
        ),
    )
    rows.append(
        Record(
            name="turing_linears_rank_share_host",
            seconds=share["seconds"],
            baseline_seconds=share["seconds"],
            ratio=1.0,
            peak_gib=share["weights_gib"],
            variant=f"one rank's share ({share['blocks']} int8 blocks, {share['weights_gib']} GiB on the device) built "
            f"as a rank fills its rows, in a process of its own: host private {share['host_private_gib']} GiB "
            f"(h3serve plan: {share['planned_runtime_gib']} GiB runtime a rank, nothing pinned)",
            baseline="none (a build time and a host peak)",
            **{**common, "host_peak_gib": share["host_private_gib"]},
        )
    )
    return rows


def main(argv: list[str] | None = None) -> list[Record]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="480x832x124", help="HxWxF of the bf16 comparison")
    p.add_argument("--drive-size", default="128x224x124", help="HxWxF of the driven forwards (several run)")
    p.add_argument("--quick", action="store_true", help="the tiny model on the CPU (a smoke test)")
    p.add_argument(RANK_SHARE, action="store_true", help=argparse.SUPPRESS)  # step 3's child
    add_output_arguments(p)
    args = p.parse_args(argv)
    args.command = command_line("bench.turing_linears", argv)
    if args.quick:
        args.size = args.drive_size = "32x64x124"
    device = "cpu" if args.quick else "cuda"
    if args.rank_share:
        print(json.dumps(rank_share(args.quick, device)), flush=True)
        return []
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # the fp32 stream's big temporaries
    size, drive_size = Size.parse(args.size), Size.parse(args.drive_size)
    with host_peak(lambda: [os.getpid()]) as host:
        compared = compare(args, size, device)
        drove = driven(args, drive_size, device)
    args.host_peak_gib = round(host.private_gib, 2)
    share = rank_share_host(args.quick)
    rows = records(size, drive_size, compared, drove, share, args, device)
    print(f"{'measurement':34} {'seconds':>8} {'bf16 s':>8} {'peak GiB':>8} {'rel L2 vs bf16':>14}  variant")
    for r in rows:
        error = "" if r.rel_err_bf16 is None else f"{r.rel_err_bf16:.3e}"
        print(f"{r.name:34} {r.seconds:8.3f} {r.baseline_seconds:8.3f} {r.peak_gib:8.2f} {error:>14}  {r.variant}")
    print(f"host peak (this process, private): {args.host_peak_gib} GiB; device {device_label(device)}")
    if os.environ.get("OUT"):
        payload = {
            "compared": [asdict(c) for c in compared],
            "driven": asdict(drove),
            "host_peak_gib": args.host_peak_gib,
            "rank_share": share,
        }
        Path(os.environ["OUT"], "turing_linears.json").write_text(json.dumps(payload, indent=1))
    if args.write:
        update_results(rows, args.results, args.markdown)
    return rows


if __name__ == "__main__":
    main()
