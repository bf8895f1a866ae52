"""The services side of the end-to-end benches (bench/e2e.py, bench/fault_walk.py): the deployment they start, built
from --dit / --vae / --gpus or a shipped profile, the request they send, and what they report of it."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import grpc
import torch

from bench.deployment import profile_deployment
from bench.dit_step import parse_variant
from bench.placement import PLACEMENTS, Placement
from bench.vae_decode import VaeVariant
from h3serve.common.config import DeployConfig, load_deploy
from h3serve.common.deploy_toml import dumps
from h3serve.common.free_ports import free_port
from h3serve.common.memory_plan import card_size
from h3serve.runtime import quantised_store
from h3serve.services.vae.mux import PRESET, THREADS

PROMPT = (
    "A red fox trots through fresh snow between tall pines at dawn; wind lifts powder from the "
    "branches, low sun throws long blue shadows, the fox stops, turns its head toward the camera, "
    "breath steaming, then bounds away over a ridge as black crows call above."
)
SEED = 1234
ADAPTER = "turbo"  # --adapter-rank: a random LoRA of that rank on every block linear, named so on both sides
RAW_BYTES = 8 << 30  # the VAE's include_raw limit here: a 768x1344x124 video is 1.5 GB of float frames
START_TIMEOUT_S = 900  # [supervisor] start_timeout_s of the bench's deployments: --warm-start compiles before SERVING


def placement(args, device: str) -> Placement:
    return Placement.plan(args.gpus, args.placement, args.dit_fsdp == "on", cuda=device.startswith("cuda"))


def deployment(args, device: str, work: Path) -> Path:
    """The services placed by --gpus / --placement (bench/placement.py), loopback ports, the encoder cache off,
    the fast paths from --dit / --vae."""
    if args.deploy:
        return profile_deployment(Path(args.deploy), profile_changes(args, work), work / "deploy.toml")
    dit, vae, place = parse_variant(args.dit), VaeVariant.parse(args.vae), placement(args, device)
    caches = {"compile_cache_dir": args.compile_cache} if args.compile_cache else {}

    def common(gpus: str) -> dict:
        return {**({"gpus": gpus} if gpus else {}), "device": device, "dtype": args.dtype, "port": free_port()}

    dit_keys = {
        "world_size": place.world_size,
        "fsdp": place.fsdp,
        "workflows": ["t2va"],
        "attention_backend": dit.attention,
        "compile": dit.compile,
        "compile_dynamic": dit.dynamic,
        "fp8": dit.fp8,
        **caches,
        **({"fp8_cache_dir": args.fp8_cache} if args.fp8_cache else {}),
        **({"warmup": args.sizes.split(",")} if args.warm_start else {}),
        **({"adapters": {ADAPTER: args.adapter_file}} if args.adapter_file else {}),
        **({"transformer_file": args.transformer_file} if args.transformer_file else {}),
    }
    vae_keys = {
        "attention_backend": vae.fast.attention,
        "compile": vae.fast.compile,
        "compile_dynamic": vae.fast.dynamic,
        "fp8": vae.fast.fp8,
        "tile_batch": vae.tile_batch,
        **caches,
        "x264_preset": mux_preset(args),
        "x264_threads": x264_threads(args),
        "max_raw_bytes": RAW_BYTES,
    }
    sections = {
        "model": {"dir": args.model_dir or ""},
        "encoder": {**common(place.encoder), "cache_bytes": 0},
        "dit": {**common(place.dit), **dit_keys},
        "vae": {**common(place.vae), **vae_keys},
        "gateway": {"port": free_port(), "data_dir": str(work / "gateway")},
        "supervisor": {"start_timeout_s": START_TIMEOUT_S},
    }
    path = work / "deploy.toml"
    path.write_text(dumps(sections))
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
    if args.one_gpu:
        _onto_one_gpu(changes)
    # only --fp8-cache's and --int8-cache's: a profile's own directories would carry the quantised weights from one
    # run into the next
    changes["dit"]["fp8_cache_dir"] = args.fp8_cache
    changes["encoder"]["int8_cache_dir"] = args.int8_cache
    return changes


def _onto_one_gpu(changes: dict[str, dict]) -> None:
    """--one-gpu: every stage on GPU 0 and the DiT a one-rank group, each stage's kernels, precisions and weight
    forms as the profile ships them. The memory limits go (one card holds what the profile spreads over several),
    and so does what needs bitsandbytes, which the lent machines lack: an nf4 encoder runs as torchao's int8. The
    encoder's layers are streamed from the host (as the one-H100 profile's are): an 80 GB card does not hold them
    beside a whole DiT."""
    for name in ("encoder", "dit", "vae"):
        changes[name] |= {"gpus": "0", "memory_limit_gib": 0.0}
    changes["dit"] |= {"world_size": 1, "ulysses_degree": 0, "fsdp": False}
    changes["encoder"] |= {"spread": False, "cpu_offload": True}
    changes["supervisor"] |= {"gpu_memory_gib": 0.0}
    if importlib.util.find_spec("bitsandbytes") is None:
        changes["encoder"] |= {"quantize": "int8"}


def mux_preset(args) -> str:
    """The x264 preset both sides mux with: --x264-preset, else the --deploy profile's own, else the muxer's default."""
    if args.x264_preset:
        return args.x264_preset
    return load_deploy(args.deploy).vae.x264_preset if args.deploy else PRESET


def x264_threads(args) -> int:
    """--quick compares the two sides' MP4 bytes, which only one x264 thread reproduces (h3serve/common/config/)."""
    return 1 if args.quick else THREADS


def cache_state(args) -> str:
    """What --compile-cache, --fp8-cache and --int8-cache held before the services started: a warm restart loads
    them, a cold start fills them."""
    caches = {"compile cache": args.compile_cache, "fp8 cache": args.fp8_cache, "int8 cache": args.int8_cache}
    return "".join(
        f", {what} {'filled: ' + format(size / 2**20, '.0f') + ' MiB' if size else 'empty'} at start"
        for what, directory in caches.items()
        if (size := _bytes_in(directory)) is not None
    )


def _bytes_in(directory: str) -> int | None:
    """The bytes of the files under `directory`; None when no directory was given."""
    if not directory:
        return None
    return sum(f.stat().st_size for f in Path(directory).rglob("*") if f.is_file())


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


def wait_for_fp8_save(directory: str, timeout_s: float = 600.0) -> None:
    """The DiT writes the fp8 weights while it warms up and serves (h3serve/runtime/quantised_store.py), and a stop
    loses a save in flight: wait for it, so the next run of the bench starts from the file as a restart would."""
    if not directory or not quantised_store.saves_in_flight(Path(directory)):
        return
    started = time.perf_counter()
    while quantised_store.saves_in_flight(Path(directory)) and time.perf_counter() - started < timeout_s:
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


def print_logs(work: Path, lines: int = 30) -> None:
    for log in sorted(work.glob("*.log")):
        print(f"--- last {lines} lines of {log.name}", file=sys.stderr)
        print("\n".join(log.read_text(errors="replace").splitlines()[-lines:]), file=sys.stderr)


def services_text(args, place: Placement) -> str:
    """The deployment `deployment` built, as a record names it."""
    weights = f", DiT transformer_file {Path(args.transformer_file).name}" if args.transformer_file else ""
    if args.deploy:
        shipped = "on one GPU (a one-rank DiT group, no memory limits)" if args.one_gpu else "as shipped"
        return f"gRPC services, deployment {args.deploy} {shipped}{weights}"
    return (
        f"gRPC services (encoder, DiT, VAE, gateway; {place.describe()}), DiT {args.dit}, VAE {args.vae}"
        + (f", x264 {mux_preset(args)}" if mux_preset(args) != PRESET else "")
        + weights
    )


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
        "--one-gpu",
        action="store_true",
        help="with --deploy: the profile's stages all on GPU 0, the DiT a one-rank group, memory limits off (a "
        "several-GPU profile's kernels and precisions served on the one lent card)",
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
    parser.add_argument(
        "--int8-cache",
        default="",
        help="with --deploy: the encoder's int8_cache_dir (a profile whose encoder streams or spreads int8 layers): "
        "the first start saves them, a restart assigns them instead of quantising",
    )
