"""End to end on one machine: a request through the real gRPC services vs diffusers' in-process pipeline.

Both sides run the same t2va request (prompt, size, steps, seed) on the same weights (`random:full` on a GPU,
`--quick`: the tiny preset on CPU); stage times, memory peaks, the MP4s and the decoded frames are compared.
`--side in-process` / `--side services` split a comparison over calls. How to run it, the placements and what
the measurements say: docs/gpu-benchmarks.md.

    python -m bench.e2e --quick                                                 # CPU smoke test
    python -m bench.e2e --sizes 768x1344x124,480x832x124 --steps 4 --write     # one GPU
"""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import multiprocessing
import os
import shutil
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from bench import in_process_offload
from bench.common import Size, device_label, gpu_peak, host_peak, leaves_gpu_empty, software
from bench.e2e_sides import (
    STAGES,
    Comparison,
    Run,
    Side,
    baseline_output,
    load_baseline,
    print_table,
    save_baseline,
    stage_text,
)
from bench.results import Record, add_output_arguments, command_line, summed, update_results
from bench.served import (
    ADAPTER,
    PROMPT,
    SEED,
    add_deployment_arguments,
    cache_state,
    deployment,
    dit_group,
    dit_info,
    emulated_card,
    mux_preset,
    placement,
    print_logs,
    refuse_early,
    services_text,
    wait_for_fp8_save,
    x264_threads,
)
from bench.stage_clock import StageClock
from h3serve.cli.reference import (
    ReferenceRequest,
    load_adapters,
    reference_pipeline,
    resolved_params,
    run_pipeline,
)
from h3serve.common.config import AdapterSource, load_deploy
from h3serve.model.adapters import DEFAULT_SHIFTS
from h3serve.runtime.models import ModelSource
from h3serve.services.vae.mux import encode_mp4
from h3serve.v1 import common_pb2

OUTPUTS = (".mp4", ".npz")  # what each side's last request leaves for the comparison: the MP4, the raw output
ALONE = "none"  # --baseline-file of a services run compared with nothing
PIPELINE_STAGES = {"text_encoder": "encode", "denoise": "denoise", "decode": "decode"}


def device_used_gib(device: str, gpus: int = 1) -> float:
    """Memory in use by every process on the fullest of the first `gpus` GPUs (the services' caching
    allocators hold their peaks)."""
    if not device.startswith("cuda"):
        return 0.0
    used = [total - free for free, total in (torch.cuda.mem_get_info(i) for i in range(gpus))]
    return round(max(used) / 2**30, 2)


def repeated(once, args) -> list[Run]:
    """`once(steps)` for warm-up (kernels, allocator, compile: the same shapes with fewer steps), then timed."""
    once(args.warmup_steps)
    return [once(args.steps) for _ in range(args.repeats)]


def in_process(sizes: list[Size], args, device: str, out: Path, keep: Path | None = None) -> dict[Size, Side]:
    """The baseline, in a process of its own: when it exits, the device is free for the services. With `keep` (a
    baseline file), each size is saved there as soon as it is measured: a call cut by its time limit keeps the sizes
    it finished."""
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        sides = pool.submit(_in_process, sizes, args, device, out, keep).result()
    print(f"in process done: {device_used_gib(device)} GiB in use on the device", flush=True)
    return sides


def _in_process(sizes: list[Size], args, device: str, out: Path, keep: Path | None) -> dict[Size, Side]:
    # sampled in the child itself, from before the pipeline loads: its own peak, as the services' is theirs
    with host_peak(lambda: [os.getpid()]) as host:

        def measured(size: Size, side: Side) -> None:  # the host's peak so far: the sizes measured until now
            if keep is not None:
                keep_baseline(keep, args, size, side.with_host(host), out)

        sides = _pipeline_sides(sizes, args, device, out, measured)
    return {size: side.with_host(host) for size, side in sides.items()}


def keep_baseline(baseline_file: Path, args, size: Size, side: Side, out: Path) -> None:
    """One size's in-process medians and outputs, where the `--side services` calls compare with them."""
    save_baseline(baseline_file, args, {size: side})
    for suffix in OUTPUTS:
        shutil.copyfile(out / f"in-process-{size}{suffix}", baseline_output(baseline_file, size, suffix))
    print(f"in process {size}: median {side.seconds:.2f} s ({stage_text(side)}); saved to {baseline_file}", flush=True)


def _pipeline_sides(sizes: list[Size], args, device: str, out: Path, measured) -> dict[Size, Side]:
    started = time.perf_counter()
    offload = args.in_process_offload
    source = ModelSource(args.model_dir or None)
    pipe = reference_pipeline(source, device=in_process_offload.load_device(offload, device), dtype=args.dtype)
    sources = {ADAPTER: AdapterSource(path=args.adapter_file)} if args.adapter_file else {}
    load_adapters(pipe, sources)  # as a diffusers user loads a LoRA: load_lora_weights, set_adapters
    in_process_offload.apply(pipe, offload, device, args.offload_margin)
    ready_s = time.perf_counter() - started
    clock = StageClock(pipe, PIPELINE_STAGES, device)

    def params(steps: int) -> common_pb2.GenerationParams:  # the adapter (if any) at weight 1, the given shift
        given = common_pb2.GenerationParams(num_inference_steps=steps, seed=SEED, flow_shift=args.flow_shift)
        given.adapters.extend(common_pb2.Adapter(name=name) for name in sources)
        return resolved_params(sources, given, steps)

    def once(size: Size, steps: int) -> Run:
        clock.reset()
        started = time.perf_counter()
        result = run_pipeline(
            pipe,
            ReferenceRequest(
                PROMPT,
                size.height,
                size.width,
                size.frames,
                params(steps),
            ),
        )
        muxed = time.perf_counter()
        video = encode_mp4(
            result["frames"],
            result["audio"],
            int(result["sample_rate"]),
            lambda *_: None,
            mux_preset(args),
            x264_threads(args),
        )
        (out / f"in-process-{size}.mp4").write_bytes(video)
        done = time.perf_counter()
        np.savez(out / f"in-process-{size}.npz", frames=result["frames"], audio=result["audio"])  # untimed
        return Run(done - started, {**clock.seconds, "mux": done - muxed}, hashlib.sha256(video).hexdigest())

    sides = {}
    for size in sizes:
        print(f"in process {size}: warm-up + {args.repeats} runs", flush=True)
        runs = repeated(lambda steps, size=size: once(size, steps), args)
        sides[size] = Side.of(runs, device_used_gib(device), ready_s=ready_s)
        measured(size, sides[size])
    return sides


def served_request(client, size: Size, steps: int, events: list, args, include_raw: bool = False):
    from h3serve.client import describe_event
    from h3serve.v1 import common_pb2, gateway_pb2

    params = common_pb2.GenerationParams(
        num_inference_steps=steps,
        seed=SEED,
        include_raw=include_raw,
        flow_shift=args.flow_shift,
        adapters=[common_pb2.Adapter(name=ADAPTER)] if args.adapter_file else [],
    )
    request = gateway_pb2.GenerateRequest(
        prompt=PROMPT, height=size.height, width=size.width, num_frames=size.frames, params=params
    )
    final = client.generate(request, events.append)
    if final.WhichOneof("kind") != "done":
        raise RuntimeError(f"job {final.job_id} {describe_event(final)}")
    return final


def served_raw(client, size: Size, steps: int, out: Path, args) -> Path:
    """The same request once more, untimed, with the decoded frames and waveform (raw.npz) downloaded."""
    final = served_request(client, size, steps, [], args, include_raw=True)
    return client.download(final.done.raw.artifact_id, out / f"served-{size}.npz")


def served_once(client, size: Size, steps: int, out: Path, args) -> Run:
    events = []
    started = time.perf_counter()
    final = served_request(client, size, steps, events, args)
    path = client.download(final.done.video.artifact_id, out / f"served-{size}.mp4")
    seconds = time.perf_counter() - started
    hits = [e.encoding.cache_hit for e in events if e.WhichOneof("kind") == "encoding"]
    if hits != [False]:
        raise RuntimeError(f"job {final.job_id}: expected one encoder run (cache off), got cache hits {hits}")
    stages = {s.stage: s.seconds for s in client.job(final.job_id).stages}
    return Run(seconds, stages, hashlib.sha256(path.read_bytes()).hexdigest())


def through_services(sizes: list[Size], args, device: str, work: Path, config_path: Path) -> dict[Size, Side]:
    from h3serve.cli.launcher import ServiceGroup
    from h3serve.client import GatewayClient

    config, place = load_deploy(config_path), placement(args, device)
    group = ServiceGroup(config, str(config_path), log_dir=str(work))
    started = time.perf_counter()
    try:
        # the host sampler asks for the services' pids at every sample: it starts before they do, so their start-up
        # (loading, --warm-start's compile) is in the peak; with the fork server, it and all its children (the DiT's
        # ranks among them) count, each child's resident pages including those it still shares with the server
        with (
            leaves_gpu_empty(),
            gpu_peak() as gpu,
            host_peak(group.process_roots) as host,
            group,
        ):
            ready_s = time.perf_counter() - started
            print(f"services healthy in {ready_s:.1f} s; DiT {dit_group(config, place)}", flush=True)
            client = GatewayClient(f"127.0.0.1:{config.gateway.port}")
            try:
                sides = {}
                for size in sizes:
                    once = functools.partial(served_once, client, size, out=work, args=args)
                    first_run = once(args.steps) if args.warm_start else None  # warmed at start, or not
                    first = first_run.seconds if first_run else 0.0
                    print(
                        f"services {size}: "
                        + (
                            f"first request {first:.2f} s ({stage_text(first_run)}), then "
                            if first_run
                            else "warm-up + "
                        )
                        + f"{args.repeats} runs",
                        flush=True,
                    )
                    if first_run:  # --repeats 0: the first request after SERVING is the one timed
                        runs = [once(args.steps) for _ in range(args.repeats)] or [first_run]
                    else:
                        runs = repeated(once, args)
                    served_raw(client, size, args.steps, work, args)
                    peaks = [round(r.peak_bytes / 2**30, 2) for r in dit_info(config).ranks]
                    print(f"services {size}: the DiT ranks' peaks {peaks} GiB", flush=True)
                    sides[size] = Side.of(runs, device_used_gib(device, place.gpus), peaks, ready_s, first)
                    # printed now: a call cut by its time limit before the rows are written still has the medians
                    median = sides[size]
                    text = f"median of {len(runs)} {median.seconds:.2f} s ({stage_text(median)})"
                    print(f"services {size}: {text}", flush=True)
                wait_for_fp8_save(args.fp8_cache)
                names = {service.process.pid: service.name for service in group.running}
            finally:
                client.close()
    except BaseException:
        print_logs(work)
        raise
    sides = {size: side.with_host(host) for size, side in sides.items()}
    if not gpu.mib:
        print(f"services: at most {host.describe()} while they started and ran, all processes together", flush=True)
        return sides
    peak, processes = round(max(gpu.mib) / 1024, 2), gpu.by_process(names)
    print(
        f"services: at most {peak} GiB in use on the fullest GPU while they ran, all processes together, "
        + gpu.describe()
        + (f" (the card they emulate: {card} GiB)" if (card := emulated_card(config)) else "")
        + f"; {host.describe()}",
        flush=True,
    )
    if processes:
        print(f"services: each process's own GPU peak: {summed(processes, 2)} GiB (what h3serve plan adds up)")
    return {size: replace(side, used_gib=peak, process_peaks_gib=processes) for size, side in sides.items()}


def records(size: Size, ours: Side, base: Side | None, args, device: str, command: str) -> list[Record]:
    """The end-to-end record, then one per stage (transport: what neither side spends in a stage).

    device and world_size are the services' (N GPUs, the DiT's ranks); the baseline always ran on one. No baseline
    (--baseline-file none): the services' figures alone, baseline seconds and ratio 0."""
    name, place = f"e2e_{size}_{args.steps}steps", placement(args, device)
    base = base or Side(0.0, dict.fromkeys(STAGES, 0.0), 0.0, "", 0.0)
    rows = [(name, ours.seconds, base.seconds)]
    rows += [(f"{name}_{s}", ours.stages[s], base.stages[s]) for s in STAGES]
    rows.append((f"{name}_transport", ours.transport, base.transport))
    if ours.first_s:  # --warm-start: the first request after SERVING and start to SERVING, against the pipeline
        rows += [
            (f"{name}_first_request", ours.first_s, base.seconds),
            (f"{name}_start_to_ready", ours.ready_s, base.ready_s),
        ]
    common = dict(
        device=device_label(device, place.gpus),
        world_size=place.world_size,
        dtype=args.dtype,
        peak_gib=ours.used_gib,
        rank_peaks_gib=ours.rank_peaks_gib,
        process_peaks_gib=ours.process_peaks_gib,
        host_peak_gib=ours.host_peak_gib,
        host_file_gib=ours.host_file_gib,
        host_used_gib=ours.host_used_gib,
        command=command,
        date=datetime.date.today().isoformat(),
        software=software(),
        variant=services_text(args, place) + adapted(args) + args.cache_state,
        baseline=(
            f"diffusers MiniMaxH3Blocks in process on {device_label(device)}"
            + in_process_offload.described(args.in_process_offload, args.offload_margin)
            + " + the same MP4 mux"
            + adapted(args)
            if base.seconds
            else "none in this run (--baseline-file none: the services alone)"
        ),
    )
    return [Record(name=n, seconds=s, baseline_seconds=b, ratio=b / s if s > 0 else 0.0, **common) for n, s, b in rows]


def adapted(args) -> str:
    """What the request ran with beyond the base model, on both sides."""
    lora = f", LoRA rank {args.adapter_rank} on every block linear" if args.adapter_rank else ""
    return lora + (f", flow shift {args.flow_shift:g}" if args.flow_shift != DEFAULT_SHIFTS["flow_shift"] else "")


def adapter_file(args, work: Path) -> str:
    """The random LoRA both sides load (bench/adapters.py's), written from a weightless transformer."""
    from bench.adapters import write_lora
    from bench.dit_step import components

    model = components(args.quick, "cpu" if args.quick else "meta", getattr(torch, args.dtype))["transformer"]
    return str(write_lora(model, work / f"{ADAPTER}.safetensors", args.adapter_rank, seed=0))


def served_alone(served: dict[Size, Side], work: Path, args, device: str) -> list[Comparison]:
    """--baseline-file none: the services' figures and whether every raw output value is finite, with nothing to
    compare them with (where the in-process pipeline cannot load, and a profile's numbers are the question); with
    --write, their rows (baseline seconds 0)."""
    for size, side in served.items():
        with np.load(work / f"served-{size}.npz") as raw:
            finite = {name: bool(np.isfinite(raw[name]).all()) for name in raw.files}
        print(f"services alone {size}: {side}; raw outputs finite: {finite}", flush=True)
    if args.write:
        rows = [r for size, side in served.items() for r in records(size, side, None, args, device, args.command)]
        update_results(rows, args.results, args.markdown)
    return []


def run(args, sizes: list[Size], device: str, work: Path) -> tuple[list[Comparison], str]:
    """The side(s) --side asks for, in `work`; the comparisons (none for --side in-process) and the command."""
    baseline_file, command = Path(args.baseline_file), args.command
    if args.side != "services":
        in_process_offload.refuse_a_small_host(args.in_process_offload, args.model_dir, args.dtype)
    if args.side != "in-process":
        try:
            config_path = deployment(args, device, work)
        except ValueError as exc:
            raise SystemExit(f"bench.e2e: {exc}") from exc
        refuse_early(load_deploy(config_path), placement(args, device), device)
        print(f"services placed on {placement(args, device).describe()}", flush=True)
    if args.side == "services" and args.baseline_file == ALONE:
        return served_alone(through_services(sizes, args, device, work, config_path), work, args, device), command
    if args.side == "services":
        baseline, baseline_command = load_baseline(baseline_file, args)
        command = f"{baseline_command}; {args.command}"
        reference = {
            (size, suffix): baseline_output(baseline_file, size, suffix) for size in sizes for suffix in OUTPUTS
        }
        missing = [str(path) for path in reference.values() if not path.exists()]
        if missing:
            raise SystemExit(
                f"--side services: the in-process outputs {missing} are missing; run --side in-process again"
            )
    elif args.side == "in-process":
        in_process(sizes, args, device, work, keep=baseline_file)
        print(f"in-process medians saved to {baseline_file}; next: the same command with --side services")
        return [], command
    else:
        baseline = in_process(sizes, args, device, work)
        reference = {(size, suffix): work / f"in-process-{size}{suffix}" for size in sizes for suffix in OUTPUTS}
    served = through_services(sizes, args, device, work, config_path)
    return [
        Comparison.of(
            size,
            baseline[size],
            served[size],
            *((reference[size, suffix], work / f"served-{size}{suffix}") for suffix in OUTPUTS),
        )
        for size in sizes
    ], command


def parser() -> argparse.ArgumentParser:
    """bench.e2e's arguments (the tests build theirs from it, so a new one reaches them with its default)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny preset on CPU: a smoke test of the harness")
    p.add_argument("--sizes", default="768x1344x124,480x832x124")
    p.add_argument("--steps", type=int, default=4, help="num_inference_steps (N gives N-1 DiT forwards)")
    p.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="timed requests after the warm-up; with --warm-start --side services 0 times the first request after "
        "SERVING alone (a 50-step 768x1344x124 request and its untimed raw run then fit one 10-minute call)",
    )
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=3,
        help="num_inference_steps of the warm-up request (3: both DiT forward variants compile)",
    )
    add_deployment_arguments(p)
    p.add_argument("--out", help="keep the MP4s and service logs here (default: a temporary directory)")
    p.add_argument(
        "--side",
        choices=("both", "in-process", "services"),
        default="both",
        help="one side per call when both do not fit in one: in-process saves its medians to "
        "--baseline-file, services compares with them (the same machine, the same options)",
    )
    p.add_argument(
        "--baseline-file",
        default="var/e2e-baseline.json",
        help=f"where --side in-process saves its medians for --side services; {ALONE!r} with --side services: the "
        "services alone, nothing compared and no rows written (their figures and a finite check are printed)",
    )
    p.add_argument(
        "--adapter-rank",
        type=int,
        default=0,
        help="both sides run a random LoRA of this rank on every block linear (a few-step adapter's "
        "cost; 0: none), loaded by diffusers' load_lora_weights in process, by [dit] adapters served",
    )
    p.add_argument(
        "--flow-shift",
        type=float,
        default=DEFAULT_SHIFTS["flow_shift"],
        help="the video schedule's shift on both sides (default: the released model's, %(default)g)",
    )
    p.add_argument(
        "--in-process-offload",
        choices=in_process_offload.OFFLOADS,
        default="none",
        help="the in-process baseline with diffusers' own CPU offload, where the bf16 pipeline does not fit the card: "
        "model (ComponentsManager.enable_auto_cpu_offload) or sequential (apply_group_offloading, leaf level); "
        "named in the rows and the saved baseline",
    )
    p.add_argument(
        "--offload-margin",
        default=in_process_offload.DEFAULT_MARGIN,
        help="with --in-process-offload model: the memory ComponentsManager keeps free beside the model it moves in "
        "(diffusers' memory_reserve_margin, default %(default)s; 768x1344x124 ran one H100 out of memory with it)",
    )
    p.add_argument(
        "--warm-start",
        action="store_true",
        help="the DiT warms --sizes at start ([dit] warmup) and the services get no warm-up request: "
        "the first request after SERVING and start to SERVING become rows of their own",
    )
    add_output_arguments(p)
    p.set_defaults(adapter_file="")  # not an option: main writes --adapter-rank's adapter here, deployment() reads it
    return p


def main(argv: list[str] | None = None) -> list[Comparison]:
    p = parser()
    args = p.parse_args(argv)
    args.command = command_line("bench.e2e", argv)
    if args.repeats < 0:
        p.error(f"--repeats {args.repeats}: a count of timed requests, 0 or more")
    if args.repeats == 0 and not (args.warm_start and args.side == "services"):
        p.error("--repeats 0 times the first request after SERVING alone: it needs --warm-start --side services")
    args.cache_state = cache_state(args)
    if args.quick:
        args.sizes, args.dtype, args.model_dir = "32x64x124", "float32", ""
    device = "cpu" if args.quick else "cuda"
    sizes = [Size.parse(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="h3serve-e2e-") as scratch:
        work = Path(args.out or scratch)
        work.mkdir(parents=True, exist_ok=True)
        if args.adapter_rank:
            args.adapter_file = adapter_file(args, work)
        comparisons, command = run(args, sizes, device, work)
    if not comparisons:
        return []
    print_table(comparisons, in_process_offload.LABELS[args.in_process_offload])
    if args.write:
        rows = [r for c in comparisons for r in records(c.size, c.served, c.in_process, args, device, command)]
        update_results(rows, args.results, args.markdown)
    return comparisons


if __name__ == "__main__":
    main()
