"""`h3serve serve SERVICE`: one service (encoder, dit, vae or gateway) in the foreground, the deployment file's
section with the command line's flags over it."""

from __future__ import annotations

import os

from h3serve.cli import box as boxes
from h3serve.common.config import SERVICES, load_deploy, override

# Model processes share cards, so their CUDA allocators map memory in growable segments: what a compile or a request
# freed goes back whole instead of staying reserved in fragments (measured in docs/gpu-benchmarks.md). Pinned host
# memory (the encoder's 25 GiB of arenas, the DiT's staging slots) is allocated and its pages touched by 8 threads,
# then registered with CUDA, instead of cudaHostAlloc faulting every page in with one thread while it holds the
# driver's lock (torch's pinned_use_cuda_host_register). Torch reads it before CUDA starts, so it is set in the
# environment; the DiT's ranks inherit it from their launcher; a user's own setting wins.
ALLOCATOR_SETTING = (
    "PYTORCH_CUDA_ALLOC_CONF",
    "expandable_segments:True,pinned_use_cuda_host_register:True,pinned_num_register_threads:8",
)
ALLOCATOR_VARIABLES = {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"}  # torch reads either
SERVICE_FLAGS = ("host", "port", "model_dir", "device", "dtype", "attention_backend")  # over the service's section


def _run(args) -> None:
    config = load_deploy(args.config)
    if args.service == "gateway":
        from h3serve.gateway.server import serve

        serve(
            override(config.gateway, host=args.host, port=args.port, data_dir=args.data_dir, model_dir=args.model_dir)
        )
        return
    flags = {name: getattr(args, name) for name in SERVICE_FLAGS}
    if args.world_size is not None:
        if args.service != "dit":
            raise SystemExit("--world-size applies to the dit service only")
        flags["world_size"] = args.world_size
    section = override(config.service(args.service), **flags)
    boxes.require_the_card(config, args.config, on_gpu=section.device != "cpu")  # `up` checked its group already
    if not ALLOCATOR_VARIABLES & os.environ.keys():  # the DiT's ranks inherit it from their launcher
        os.environ[ALLOCATOR_SETTING[0]] = ALLOCATOR_SETTING[1]
    # the DiT's entry is its launcher, which must start its ranks without first importing what they import
    entry = "launch" if args.service == "dit" else "server"
    __import__(f"h3serve.services.{args.service}.{entry}", fromlist=["serve"]).serve(section)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="run one service in the foreground")
    p.add_argument("service", choices=[*SERVICES, "gateway"])
    p.add_argument("--config", help="deployment TOML file")
    for flag in ("host", "model-dir", "device", "dtype", "attention-backend", "data-dir"):
        p.add_argument(f"--{flag}")
    p.add_argument("--port", type=int)
    p.add_argument("--world-size", type=int, help="dit: ranks in the sharded group, started by its launcher")
    p.set_defaults(run=_run)
