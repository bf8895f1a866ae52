"""End to end on one machine: a request through the real gRPC services vs diffusers' in-process pipeline.

Both sides run the same t2va request (prompt, size, steps, seed) on the same weights: full released
sizes with random weights built on the GPU (`[model] dir = "random:full"`, h3serve/runtime/random_full.py;
`--quick`: the tiny preset on CPU). The prompt is 256 bytes, 256 tokens with the byte-level tokenizer.

1. In process (the baseline): diffusers' `MiniMaxH3Blocks` (encode, denoise, decode), then the VAE
   service's own MP4 muxer, written to a file. Stage times come from its top-level blocks
   (bench/stage_clock.py). It runs in a child process, so when it ends the device is free again: the
   two sides never hold the GPU at the same time.
2. Services: encoder, DiT, VAE and gateway started as separate processes by `ServiceGroup` from a
   deployment file written here (the encoder cache is off so every request encodes), with the `--dit` /
   `--vae` fast paths (default: native, as diffusers). Each request is timed at the client from
   `Generate` to the downloaded MP4; stage times are the gateway's job record (`GetJob`), and transport
   is what the client saw beyond them.

Placement (`--gpus N`, `--placement`, `--dit-fsdp`; bench/placement.py has the memory reasoning): N = 1
puts every service on the one device. N > 1 makes the DiT a group of Ulysses ranks, one per GPU, started
by the service itself (torchrun, NCCL); `shared` (default) spans all N GPUs with the encoder on GPU 0 and
the VAE on GPU N-1 beside the ranks: one request's latency, as SGLang's published 74.38 s runs Ulysses 4
on 4 x H200. `dedicated` is docs/deploy/h200x4.toml's layout (encoder GPU 0, DiT GPUs 1..N-2, VAE GPU N-1;
N >= 3), where stages pipeline across jobs but one request denoises on N-2 GPUs. The DiT weights are
replicated unless `--dit-fsdp on`. The baseline always runs on one GPU; the records say both: `device`
"NxGPU" and `world_size` are the services', the baseline text names its single device, and the ratio is
baseline / ours as always. A DiT group splits the sequence through diffusers' context parallelism: a
backend without it, or the local kernels (`flash4`, `cudnn_fp8`) with ring attention, or anything else the
DiT service refuses at start (too few GPUs, a bad layout) stops the bench before anything loads, with the
service's reason. `_native_cudnn` is what the deployment file and the 3.585 s/step 2-GPU measurement use;
`flash4` and `cudnn_fp8` run under Ulysses (h3serve/runtime/kernels/local.py).

One warm-up request per side and size (`--warmup-steps`: the same shapes; 3 steps run both DiT forward
variants), then the median of `--repeats`. `--warm-start` measures what a user meets instead: the DiT
declares `--sizes` as its `[dit] warmup` shapes (compiled and run before it says SERVING), the services get
no warm-up request, and the first request after SERVING and the start-to-SERVING time become rows of their
own (beside the in-process pipeline's load time), the first request with its stages printed. `--compile-cache
DIR` is the services' `compile_cache_dir` and `--fp8-cache DIR` the DiT's `fp8_cache_dir`: the same command twice
measures a cold start, then a warm restart (the records say what the caches held at start). `--deploy F` serves a
shipped profile instead of the deployment built from `--dit` / `--vae` / `--gpus`: its placement, memory limits,
offload and fast paths as they ship, with the weights, ports, data directory and this run's adapter and warm-up
shapes put in (give `--gpus` / `--dit-fsdp` to match its DiT group, which the bench checks); `--deploy
docs/deploy/single-32gb.toml` emulates the 32 GB card on an H200.

The MP4s of the last runs are compared (sha256; when they differ, decoded: bench/media_diff.py),
and so are the decoded frames and waveform before the muxer: the in-process side saves its last run's, and
the services run the request once more, untimed, with `include_raw`. The result is printed: with the default
fast paths on one device the split computes exactly what the pipeline computes; a DiT group of N ranks
computes it within float rounding (on CPU the tests check both: the same bytes and frames with one rank;
with 2 gloo ranks frames within 1e-4, the same decoded pictures, the audio within AAC's rounding of the ranks'
1e-6 differences). On a GPU the MP4 bytes alone say little: x264 does not reproduce its output on full-size
noise-like frames, so the raw frames are the comparison that counts.

    python -m bench.e2e --sizes 768x1344x124,480x832x124 --steps 4 --write     # one H200, ~6 min
    python -m bench.e2e --quick                                                 # CPU smoke test
    python -m bench.e2e --quick --gpus 2                                        # + a 2-rank gloo DiT

The 50-step 768x1344x124 request (49 DiT forwards) does not fit one 10-minute call with both sides, so
it runs as one `--side in-process` call (the diffusers pipeline on one GPU: start ~1 min, warm-up, 49 x
6.6 s = 5.4 min of denoise, ~6.5 min in all; it saves its medians to --baseline-file) and then one
`--side services` call per placement or fast path on the same warm machine (the baseline does not depend
on --gpus, --placement or the fast paths, so all of them compare with it):

    python -m bench.e2e --sizes 768x1344x124 --steps 50 --repeats 1 --side in-process
    # 1 x H200, the fast path warmed at start: the first request after SERVING alone (--repeats 0), ~3.5 min of
    # denoise, then its untimed raw run
    python -m bench.e2e --sizes 768x1344x124 --steps 50 --repeats 0 --warm-start --side services \\
        --dit cudnn_fp8+compile+dynamic+fp8 --vae _native_cudnn+compile+dynamic+tiles=28 --write
    # 2 x H200: 49 x 3.6 s = 3 min of denoise + start-up and warm-up: ~5 min
    python -m bench.e2e --gpus 2 --dit _native_cudnn --sizes 768x1344x124 --steps 50 --repeats 1 --side services --write
    # 4 x H200 (issue 7): Ulysses 4, ~1.9 s a step if it scales 3.5x: ~1.5 min of denoise, ~4 min in all;
    # bf16 with the deployment's fast path, then the fp8 option (needs torchao), then the docs' layout
    python -m bench.e2e --gpus 4 --dit _native_cudnn+compile --vae native+tiles=28 \\
        --sizes 768x1344x124 --steps 50 --repeats 1 --side services --write
    python -m bench.e2e --gpus 4 --dit _native_cudnn+compile+fp8 --vae native+tiles=28 \\
        --sizes 768x1344x124 --steps 50 --repeats 1 --side services --write
    python -m bench.e2e --gpus 4 --placement dedicated --dit _native_cudnn+compile --vae native+tiles=28 \\
        --sizes 768x1344x124 --steps 50 --repeats 1 --side services --write

With compile the warm-up request also compiles the blocks (a minute or two, every rank at once). The
local kernels run under Ulysses too: `--dit flash4+compile`, `--dit cudnn_fp8+compile+fp8` (their wheels
installed first; on one GPU they are 1.21x and 1.63x faster than cuDNN eager per step).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import grpc
import numpy as np
import torch

from bench.common import HostPeak, Size, device_label, gpu_peak, host_peak, leaves_gpu_empty, software
from bench.deployment import profile_deployment
from bench.dit_step import parse_variant
from bench.media_diff import FramesDiff, MediaDiff
from bench.placement import PLACEMENTS, Placement
from bench.results import Record, add_output_arguments, command_line, summed, update_results
from bench.stage_clock import StageClock
from bench.vae_decode import VaeVariant
from h3serve.cli.reference import (
    ReferenceRequest,
    load_adapters,
    reference_pipeline,
    resolved_params,
    run_pipeline,
)
from h3serve.common.config import AdapterSource, DeployConfig, load_deploy
from h3serve.common.free_ports import free_port
from h3serve.common.memory_plan import card_size
from h3serve.runtime import fp8_store
from h3serve.runtime.models import ModelSource
from h3serve.services.vae.mux import PRESET, THREADS, encode_mp4
from h3serve.v1 import common_pb2

PROMPT = (
    "A red fox trots through fresh snow between tall pines at dawn; wind lifts powder from the "
    "branches, low sun throws long blue shadows, the fox stops, turns its head toward the camera, "
    "breath steaming, then bounds away over a ridge as black crows call above."
)
SEED = 1234
ADAPTER = "turbo"  # --adapter-rank: a random LoRA of that rank on every block linear, named so on both sides
OUTPUTS = (".mp4", ".npz")  # what each side's last request leaves for the comparison: the MP4, the raw output
RAW_BYTES = 8 << 30  # the VAE's include_raw limit here: a 768x1344x124 video is 1.5 GB of float frames
STAGES = ("encode", "denoise", "decode", "mux")
START_TIMEOUT_S = 900  # [supervisor] start_timeout_s of the bench's deployments: --warm-start compiles before SERVING
PIPELINE_STAGES = {"text_encoder": "encode", "denoise": "denoise", "decode": "decode"}


@dataclass(frozen=True)
class Run:
    """One request: seconds at the client (or around the pipeline), its stages, the MP4's sha256."""

    seconds: float
    stages: dict[str, float]
    digest: str

    @property
    def transport(self) -> float:
        return self.seconds - sum(self.stages.get(s, 0.0) for s in STAGES)


@dataclass(frozen=True)
class Side:
    """The median over repeats of one side at one size, and its device memory: in process, in use after its runs;
    through the services, the most in use while they ran (all processes, sampled), where nvidia-smi is. Host
    memory: the most its processes held from their start to the last request (sampled, bench/common.py host_peak)."""

    seconds: float
    stages: dict[str, float]
    transport: float
    digest: str
    used_gib: float  # on the fullest GPU the side used
    rank_peaks_gib: list[float] = field(default_factory=list)  # services: each DiT rank's peak, last request
    ready_s: float = 0.0  # start to ready: the pipeline loaded / the services healthy (SERVING)
    first_s: float = 0.0  # --warm-start: the first request after SERVING, with no warm-up request
    host_peak_gib: float = 0.0  # private host memory (RssAnon + RssShmem), all the side's processes together
    host_file_gib: float = 0.0  # mapped file pages (RssFile): page cache, reclaimable
    host_used_gib: float = 0.0  # the system's used memory (MemTotal - MemAvailable) over its value at the start
    process_peaks_gib: dict[str, float] = field(default_factory=dict)  # services: each process's own GPU peak

    @classmethod
    def of(
        cls,
        runs: list[Run],
        used_gib: float,
        rank_peaks_gib: list[float] | None = None,
        ready_s: float = 0.0,
        first_s: float = 0.0,
    ) -> Side:
        stages = {s: statistics.median(r.stages.get(s, 0.0) for r in runs) for s in STAGES}
        return cls(
            statistics.median(r.seconds for r in runs),
            stages,
            statistics.median(r.transport for r in runs),
            runs[-1].digest,
            used_gib,
            rank_peaks_gib or [],
            ready_s,
            first_s,
        )

    def with_host(self, host: HostPeak) -> Side:
        return replace(
            self,
            host_peak_gib=round(host.private_gib, 2),
            host_file_gib=round(host.file_gib, 2),
            host_used_gib=round(host.used_gib, 2),
        )

    def host_text(self) -> str:
        """Its host peaks as the table prints them; "" for a side saved before they were sampled."""
        if not self.host_peak_gib:
            return ""
        return HostPeak(self.host_peak_gib, self.host_file_gib, self.host_used_gib).describe()


@dataclass(frozen=True)
class Comparison:
    size: Size
    in_process: Side
    served: Side
    media: MediaDiff  # the two MP4s decoded (zero when they are the same bytes)
    frames: FramesDiff  # the two sides' decoded frames and waveform before the muxer (the last requests)

    @property
    def same_output(self) -> bool:
        return self.in_process.digest == self.served.digest

    @classmethod
    def of(
        cls, size: Size, in_process: Side, served: Side, videos: tuple[Path, Path], raw: tuple[Path, Path]
    ) -> Comparison:
        same = in_process.digest == served.digest
        return cls(size, in_process, served, MediaDiff(0, 0.0) if same else MediaDiff.of(*videos), FramesDiff.of(*raw))


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


def in_process(sizes: list[Size], args, device: str, out: Path) -> dict[Size, Side]:
    """The baseline, in a process of its own: when it exits, the device is free for the services."""
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        sides = pool.submit(_in_process, sizes, args, device, out).result()
    print(f"in process done: {device_used_gib(device)} GiB in use on the device", flush=True)
    return sides


def _in_process(sizes: list[Size], args, device: str, out: Path) -> dict[Size, Side]:
    # sampled in the child itself, from before the pipeline loads: its own peak, as the services' is theirs
    with host_peak(lambda: [os.getpid()]) as host:
        sides = _pipeline_sides(sizes, args, device, out)
    return {size: side.with_host(host) for size, side in sides.items()}


def _pipeline_sides(sizes: list[Size], args, device: str, out: Path) -> dict[Size, Side]:
    started = time.perf_counter()
    pipe = reference_pipeline(ModelSource(args.model_dir or None), device=device, dtype=args.dtype)
    sources = {ADAPTER: AdapterSource(path=args.adapter_file)} if args.adapter_file else {}
    load_adapters(pipe, sources)  # as a diffusers user loads a LoRA: load_lora_weights, set_adapters
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
    return sides


def placement(args, device: str) -> Placement:
    return Placement.plan(args.gpus, args.placement, args.dit_fsdp == "on", cuda=device.startswith("cuda"))


def deployment(args, device: str, work: Path) -> Path:
    """The services placed by --gpus / --placement (bench/placement.py), loopback ports, the encoder cache off,
    the fast paths from --dit / --vae."""
    if args.deploy:
        return profile_deployment(Path(args.deploy), profile_changes(args, work), work / "deploy.toml")
    dit, vae, place = parse_variant(args.dit), VaeVariant.parse(args.vae), placement(args, device)

    def common(gpus: str) -> str:
        pinned = f'gpus = "{gpus}"\n' if gpus else ""
        return f'{pinned}device = "{device}"\ndtype = "{args.dtype}"\nport = {free_port()}\n'

    text = (
        f'[model]\ndir = "{args.model_dir or ""}"\n\n'
        f"[encoder]\n{common(place.encoder)}cache_bytes = 0\n\n"
        f"[dit]\n{common(place.dit)}world_size = {place.world_size}\nfsdp = {str(place.fsdp).lower()}\n"
        f'workflows = ["t2va"]\nattention_backend = "{dit.attention}"\n'
        f"compile = {str(dit.compile).lower()}\ncompile_dynamic = {str(dit.dynamic).lower()}\n"
        f"fp8 = {str(dit.fp8).lower()}\n{cache_line(args)}"
        + (f'fp8_cache_dir = "{args.fp8_cache}"\n' if args.fp8_cache else "")
        + (f"warmup = {json.dumps(args.sizes.split(','))}\n" if args.warm_start else "")
        + (f'adapters = {{ {ADAPTER} = "{args.adapter_file}" }}\n' if args.adapter_file else "")
        + (f'transformer_file = "{args.transformer_file}"\n' if args.transformer_file else "")
        + "\n"
        f'[vae]\n{common(place.vae)}attention_backend = "{vae.fast.attention}"\n'
        f"compile = {str(vae.fast.compile).lower()}\ncompile_dynamic = {str(vae.fast.dynamic).lower()}\n"
        f"fp8 = {str(vae.fast.fp8).lower()}\ntile_batch = {vae.tile_batch}\n{cache_line(args)}"
        f'x264_preset = "{mux_preset(args)}"\nx264_threads = {x264_threads(args)}\n'
        f"max_raw_bytes = {RAW_BYTES}\n\n"
        f'[gateway]\nport = {free_port()}\ndata_dir = "{work / "gateway"}"\n\n'
        f"[supervisor]\nstart_timeout_s = {START_TIMEOUT_S}\n"
    )
    path = work / "deploy.toml"
    path.write_text(text)
    return path


def profile_changes(args, work: Path) -> dict[str, dict]:
    """What --deploy changes in a profile: the weights, the encoder cache off, room for the raw output, this
    run's data directory, the request's adapter; its placement, memory and fast-path settings stay."""
    changes = {
        "model": {"dir": args.model_dir or ""},
        "encoder": {"cache_bytes": 0},
        "dit": {},
        "vae": {"max_raw_bytes": RAW_BYTES} | ({"x264_preset": args.x264_preset} if args.x264_preset else {}),
        "gateway": {"data_dir": str(work / "gateway")},
        "supervisor": {"start_timeout_s": START_TIMEOUT_S},
    }
    if args.adapter_file:
        changes["dit"]["adapters"] = {ADAPTER: args.adapter_file}
    if args.transformer_file:
        changes["dit"]["transformer_file"] = args.transformer_file
    if args.warm_start:
        changes["dit"]["warmup"] = args.sizes.split(",")
    if args.compile_cache:
        changes["dit"]["compile_cache_dir"] = changes["vae"]["compile_cache_dir"] = args.compile_cache
    # only --fp8-cache's: a profile's own directory would carry the quantised weights from one run into the next
    changes["dit"]["fp8_cache_dir"] = args.fp8_cache
    return changes


def mux_preset(args) -> str:
    """The x264 preset both sides mux with: --x264-preset, else the --deploy profile's own, else the muxer's default."""
    if args.x264_preset:
        return args.x264_preset
    return load_deploy(args.deploy).vae.x264_preset if args.deploy else PRESET


def x264_threads(args) -> int:
    """--quick compares the two sides' MP4 bytes, which only one x264 thread reproduces (h3serve/common/config.py)."""
    return 1 if args.quick else THREADS


def cache_line(args) -> str:
    return f'compile_cache_dir = "{args.compile_cache}"\n' if args.compile_cache else ""


def cache_state(args) -> str:
    """What --compile-cache and --fp8-cache held before the services started: a warm restart loads them, a cold
    start fills them."""
    return "".join(
        f", {what} {'filled: ' + format(size / 2**20, '.0f') + ' MiB' if size else 'empty'} at start"
        for what, size in (("compile cache", _bytes_in(args.compile_cache)), ("fp8 cache", _bytes_in(args.fp8_cache)))
        if size is not None
    )


def _bytes_in(directory: str) -> int | None:
    """The bytes of the files under `directory`; None when no directory was given."""
    if not directory:
        return None
    return sum(f.stat().st_size for f in Path(directory).rglob("*") if f.is_file())


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


def refuse_early(config: DeployConfig, place: Placement, device: str) -> None:
    """What the DiT service would refuse at start (its layout, too few GPUs, an attention backend that cannot
    split the sequence this way), refused now with the service's reason, before anything
    loads; the probe runs the backend once on this process's first GPU."""
    from h3serve.services.dit import config_check

    visible = torch.cuda.device_count() if device.startswith("cuda") else place.gpus
    if visible < place.gpus:
        raise SystemExit(f"bench.e2e: --gpus {place.gpus}, but {visible} GPU(s) are visible")
    try:
        config_check.check(config.dit)
    except config_check.REFUSALS as exc:
        raise SystemExit(f"bench.e2e: the DiT service would refuse to start ({place.describe()}): {exc}") from exc


def dit_info(config: DeployConfig):
    from h3serve.v1 import common_pb2, dit_pb2_grpc

    with grpc.insecure_channel(config.dit.address) as channel:
        return dit_pb2_grpc.DiTStub(channel).Info(common_pb2.InfoRequest(), timeout=30)


def dit_group(config: DeployConfig, place: Placement) -> str:
    """The group the DiT reports, checked against the placement asked for."""
    info = dit_info(config)
    if (info.world_size, info.fsdp) != (place.world_size, place.fsdp):
        raise RuntimeError(
            f"the DiT runs {info.world_size} rank(s), FSDP {info.fsdp}; the placement asked for "
            f"{place.world_size}, FSDP {place.fsdp}"
        )
    devices = ", ".join(r.device for r in info.ranks)
    return f"{info.world_size} rank(s) on {devices}, {info.compute_backend}, attention {info.attention_backend}"


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


def wait_for_fp8_save(directory: str, timeout_s: float = 600.0) -> None:
    """The DiT writes the fp8 weights while it warms up and serves (h3serve/runtime/fp8_store.py), and a stop loses
    a save in flight: wait for it, so the next run of the bench starts from the file as a restart would."""
    if not directory or not fp8_store.saves_in_flight(Path(directory)):
        return
    started = time.perf_counter()
    while fp8_store.saves_in_flight(Path(directory)) and time.perf_counter() - started < timeout_s:
        time.sleep(1.0)
    print(
        f"services: the fp8 weights in {directory} written {time.perf_counter() - started:.1f} s after the "
        "last request",
        flush=True,
    )


def emulated_card(config: DeployConfig) -> float:
    """The card that a profile emulates on a bigger GPU: its [supervisor] gpu_memory_gib, else its largest memory
    limit; 0 without either."""
    card, _ = card_size(config, (config.service(name).memory_limit_gib for name in ("encoder", "dit", "vae")))
    return card or 0.0


def stage_text(run: Run) -> str:
    stages = ", ".join(f"{stage} {run.stages.get(stage, 0.0):.2f} s" for stage in STAGES)
    return f"{stages}, transport {run.transport:.2f} s"


def setup(args) -> dict:
    """What a saved baseline must share with the services run it is compared with."""
    return {
        "sizes": args.sizes,
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "dtype": args.dtype,
        "model_dir": args.model_dir,
        "adapter_rank": args.adapter_rank,
        "flow_shift": args.flow_shift,
    }


def save_baseline(path: Path, args, sides: dict[Size, Side]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "setup": setup(args),
                "command": args.command,
                "sides": {str(size): asdict(side) for size, side in sides.items()},
            },
            indent=1,
        )
    )


def load_baseline(path: Path, args) -> tuple[dict[Size, Side], str]:
    """The in-process medians a `--side in-process` run saved, and its command; refused for another setup."""
    if not path.exists():
        raise SystemExit(f"--side services: no baseline at {path}; run with --side in-process first")
    saved = json.loads(path.read_text())
    unchecked = {"sizes": None, "warmup_steps": None}  # a subset of sizes may be compared; warm-ups are untimed
    same = {**saved["setup"], **unchecked} == {**setup(args), **unchecked}
    missing = set(args.sizes.split(",")) - set(saved["sides"])
    if not same or missing:  # a subset of its sizes may be compared: one call per size when time is short
        raise SystemExit(
            f"--side services: the baseline in {path} was measured with {saved['setup']}, this run is {setup(args)}"
        )
    return {Size.parse(size): Side(**side) for size, side in saved["sides"].items()}, saved["command"]


def print_logs(work: Path, lines: int = 30) -> None:
    for log in sorted(work.glob("*.log")):
        print(f"--- last {lines} lines of {log.name}", file=sys.stderr)
        print("\n".join(log.read_text(errors="replace").splitlines()[-lines:]), file=sys.stderr)


def records(comparison: Comparison, args, device: str, command: str) -> list[Record]:
    """The end-to-end record, then one per stage (transport: what neither side spends in a stage).

    device and world_size are the services' (N GPUs, the DiT's ranks); the baseline always ran on one."""
    name, place = f"e2e_{comparison.size}_{args.steps}steps", placement(args, device)
    ours, base = comparison.served, comparison.in_process
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
        baseline=f"diffusers MiniMaxH3Blocks in process on {device_label(device)} + the same MP4 mux" + adapted(args),
    )
    return [Record(name=n, seconds=s, baseline_seconds=b, ratio=b / s if s > 0 else 0.0, **common) for n, s, b in rows]


def services_text(args, place: Placement) -> str:
    """The deployment `deployment` built, as a record names it."""
    weights = f", DiT transformer_file {Path(args.transformer_file).name}" if args.transformer_file else ""
    if args.deploy:
        return f"gRPC services, deployment {args.deploy} as shipped{weights}"
    return (
        f"gRPC services (encoder, DiT, VAE, gateway; {place.describe()}), DiT {args.dit}, VAE {args.vae}"
        + (f", x264 {mux_preset(args)}" if mux_preset(args) != PRESET else "")
        + weights
    )


def adapted(args) -> str:
    """What the request ran with beyond the base model, on both sides."""
    lora = f", LoRA rank {args.adapter_rank} on every block linear" if args.adapter_rank else ""
    return lora + (f", flow shift {args.flow_shift:g}" if args.flow_shift != 12.0 else "")


def print_table(comparisons: list[Comparison]) -> None:
    print(
        f"{'size':16} {'':12} {'e2e s':>8} "
        + " ".join(f"{s:>8}" for s in (*STAGES, "transport"))
        + f" {'GiB used':>9}  host memory at most"
    )
    for c in comparisons:
        for label, side in (("in process", c.in_process), ("services", c.served)):
            print(
                f"{str(c.size):16} {label:12} {side.seconds:8.3f} "
                + " ".join(f"{side.stages[s]:8.3f}" for s in STAGES)
                + f" {side.transport:8.3f}"
                + f" {side.used_gib:9.2f}  {side.host_text()}"
            )
        print(
            f"{'':16} {'ratio':12} {c.in_process.seconds / c.served.seconds:8.4f}  "
            f"(in process / services; same MP4: {c.same_output}; {c.media.describe()}; {c.frames.describe()})"
        )
        if c.served.first_s:
            print(
                f"{'':16} {'first':12} {c.served.first_s:8.3f}  (the first request after SERVING: "
                f"{c.served.first_s / c.served.seconds:.3f}x the median; start to SERVING {c.served.ready_s:.1f} s, "
                f"pipeline load in process {c.in_process.ready_s:.1f} s)"
            )


def baseline_output(baseline_file: Path, size: Size, suffix: str) -> Path:
    """Where a `--side in-process` call keeps its MP4 (.mp4) and raw output (.npz) for the `--side services`
    calls that compare with it."""
    return baseline_file.with_name(f"{baseline_file.stem}-{size}{suffix}")


def adapter_file(args, work: Path) -> str:
    """The random LoRA both sides load (bench/adapters.py's), written from a weightless transformer."""
    from bench.adapters import write_lora
    from bench.dit_step import components

    model = components(args.quick, "cpu" if args.quick else "meta", getattr(torch, args.dtype))["transformer"]
    return str(write_lora(model, work / f"{ADAPTER}.safetensors", args.adapter_rank, seed=0))


def run(args, sizes: list[Size], device: str, work: Path) -> tuple[list[Comparison], str]:
    """The side(s) --side asks for, in `work`; the comparisons (none for --side in-process) and the command."""
    baseline_file, command = Path(args.baseline_file), args.command
    if args.side != "in-process":
        try:
            config_path = deployment(args, device, work)
        except ValueError as exc:
            raise SystemExit(f"bench.e2e: {exc}") from exc
        refuse_early(load_deploy(config_path), placement(args, device), device)
        print(f"services placed on {placement(args, device).describe()}", flush=True)
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
    else:
        baseline = in_process(sizes, args, device, work)
        reference = {(size, suffix): work / f"in-process-{size}{suffix}" for size in sizes for suffix in OUTPUTS}
    if args.side == "in-process":
        save_baseline(baseline_file, args, baseline)
        for (size, suffix), path in reference.items():
            shutil.copyfile(path, baseline_output(baseline_file, size, suffix))
        print(f"in-process medians saved to {baseline_file}; next: the same command with --side services")
        return [], command
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


def add_deployment_arguments(parser) -> None:
    """What `deployment` builds the services from: the weights, the fast paths, the placement or a shipped profile,
    the caches (bench.e2e's and bench.fault_walk's)."""
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--model-dir", default="random:full", help="random:full, or a local diffusers model directory")
    parser.add_argument("--dit", default="native", help="DiT service fast path: attention[+compile][+fp8]")
    parser.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="GPUs the services use (the DiT group spans them, bench/placement.py); bench.e2e's in-process "
        "baseline always runs on one. --quick: the DiT's gloo ranks on the CPU",
    )
    parser.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="shared",
        help="shared: the DiT on all GPUs, the encoder on GPU 0 and the VAE on the last one beside its "
        "ranks; dedicated: docs/deploy/h200x4.toml's layout (encoder, DiT, VAE on their own GPUs)",
    )
    parser.add_argument(
        "--dit-fsdp",
        choices=("on", "off"),
        default="off",
        help="shard the DiT weights with FSDP2 (off: replicated, they fit an H200 with room to spare)",
    )
    parser.add_argument(
        "--vae", default="native", help="VAE service fast path: attention[+compile][+dynamic][+fp8][+tiles=N]"
    )
    parser.add_argument(
        "--deploy",
        help="serve with this deployment profile (e.g. docs/deploy/single-32gb.toml) instead "
        "of --dit/--vae/--gpus: its placement, memory limits and offload as shipped",
    )
    parser.add_argument(
        "--x264-preset",
        help="libx264's preset of the services' muxer ([vae] x264_preset) and of the in-process side's mux "
        "(default: --deploy's own, else the muxer's)",
    )
    parser.add_argument(
        "--compile-cache",
        default="",
        help="the services' compile_cache_dir: run twice to measure a cold start, then a warm restart",
    )
    parser.add_argument(
        "--transformer-file",
        default="",
        help="the DiT's [dit] transformer_file (e.g. a GGUF of random:full's transformer, written by "
        "python -m bench.checkpoint_files KIND PATH)",
    )
    parser.add_argument(
        "--fp8-cache",
        default="",
        help="the DiT's fp8_cache_dir (with fp8): the first start saves the quantised weights, a restart "
        "assigns them instead of building and quantising",
    )


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
    p.add_argument("--baseline-file", default="var/e2e-baseline.json")
    p.add_argument(
        "--adapter-rank",
        type=int,
        default=0,
        help="both sides run a random LoRA of this rank on every block linear (a few-step adapter's "
        "cost; 0: none), loaded by diffusers' load_lora_weights in process, by [dit] adapters served",
    )
    p.add_argument("--flow-shift", type=float, default=12.0, help="the video schedule's shift on both sides")
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
    print_table(comparisons)
    if args.write:
        update_results([r for c in comparisons for r in records(c, args, device, command)], args.results, args.markdown)
    return comparisons


if __name__ == "__main__":
    main()
