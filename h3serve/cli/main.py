"""The `h3serve` command: serve one service, start them all, generate, compare with diffusers."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from h3serve.cli import experiment, generate_help, plan
from h3serve.common.config import SERVICES, ConfigError, load_deploy, override
from h3serve.model import rules

CONNECT_TIMEOUT_S = 10.0  # how long `generate` waits for the gateway to answer before saying nobody does
# Model processes share cards, so their CUDA allocators map memory in growable segments: what a compile or a request
# freed goes back whole instead of staying reserved in fragments (a cold DiT start on the 32 GB profile reserved
# 30.8 GiB for at most 11.5 GiB of tensors; 21.8 with this). Torch reads it before CUDA starts, so it is set in the
# environment; the DiT's ranks inherit it from their launcher; a user's own setting wins.
ALLOCATOR_SETTING = ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
ALLOCATOR_VARIABLES = {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"}  # torch reads either


def _serve(args) -> None:
    config = load_deploy(args.config)
    if args.service == "gateway":
        from h3serve.gateway.server import serve

        serve(
            override(config.gateway, host=args.host, port=args.port, data_dir=args.data_dir, model_dir=args.model_dir)
        )
        return
    flags = dict(
        host=args.host,
        port=args.port,
        model_dir=args.model_dir,
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
    )
    if args.world_size is not None:
        if args.service != "dit":
            raise SystemExit("--world-size applies to the dit service only")
        flags["world_size"] = args.world_size
    section = override(config.service(args.service), **flags)
    if not ALLOCATOR_VARIABLES & os.environ.keys():  # the DiT's ranks inherit it from their launcher
        os.environ[ALLOCATOR_SETTING[0]] = ALLOCATOR_SETTING[1]
    # the DiT's entry is its launcher, which must start its ranks without first importing what they import
    entry = "launch" if args.service == "dit" else "server"
    __import__(f"h3serve.services.{args.service}.{entry}", fromlist=["serve"]).serve(section)


def _up(args) -> None:
    from h3serve.cli.launcher import ServiceGroup
    from h3serve.cli.supervise import Watch
    from h3serve.common.processes import StopSignals
    from h3serve.common.supervision import STATE_FILE

    config = load_deploy(args.config)
    stop = StopSignals()  # SIGINT, SIGTERM, SIGHUP: the services have sessions of their own, so stop them here
    # The watch's state file, for the gateway: in a directory of this `up`'s own, so no other stack (one sharing the
    # log dir or the data_dir, refused or not) can overwrite it; it goes when `up` ends.
    state_dir = tempfile.TemporaryDirectory(prefix="h3serve-up-")
    group = ServiceGroup(config, args.config, args.log_dir, supervisor_state=os.path.join(state_dir.name, STATE_FILE))
    try:
        group.start()
        reason = Watch(group, stop).run(
            lambda: print(
                f"h3serve up: gateway on {config.gateway.host}:{config.gateway.port}; Ctrl-C stops everything",
                flush=True,
            )
        )
        print(
            f"h3serve up: {reason}; stopping everything" if reason else "stopping",
            flush=True,
            file=sys.stderr if reason else sys.stdout,
        )
    finally:
        group.stop()
        state_dir.cleanup()
    if reason:
        raise SystemExit(1)


def _request(args):
    from h3serve.v1 import common_pb2, gateway_pb2

    def given(name):
        return getattr(args, name, None)

    params = common_pb2.GenerationParams(
        num_inference_steps=args.steps or 0,
        include_raw=bool(given("raw")),
        adapters=args.adapter,
        flow_shift=args.flow_shift,
        audio_flow_shift=args.audio_flow_shift,
    )
    if given("seed") is not None:
        params.seed = args.seed
    return gateway_pb2.GenerateRequest(
        prompt=args.prompt,
        height=args.height or 0,
        width=args.width or 0,
        num_frames=given("num_frames") or 0,
        seconds=given("seconds") or 0.0,
        params=params,
        request_id=given("request_id") or "",
    )


class Progress:
    """A job's events on `stream`: on a terminal one line redrawn in place; to a pipe or a file one plain line per
    event, since the erase-line escapes that redraw it are noise to anything but a terminal."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.live = getattr(stream, "isatty", lambda: False)()

    def __call__(self, event) -> None:
        from h3serve.client import describe_event

        if self.live:
            print(f"\r\x1b[K{describe_event(event)}", end="", file=self.stream, flush=True)
        else:
            print(describe_event(event), file=self.stream, flush=True)

    def end(self) -> None:
        if self.live:
            print(file=self.stream)  # keeps the last line


def generate(
    address: str,
    request,
    out: str | Path | None,
    raw: str | None,
    stream=sys.stderr,
    media=None,
    root_pem: bytes | None = None,
    token: str | None = None,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
):
    """Run one generation through the gateway, its progress on `stream`; returns (job, mp4 path).

    `media` (keyframe / reference files, see `_media`) are uploaded first and the request refers to them by id.
    `root_pem` and `token` reach a gateway that serves TLS and requires a bearer token. The client submits, then
    follows the job's events, attaching again after a gateway restart: the progress goes on where it was. A gateway
    that does not answer within `connect_timeout_s` raises GatewayUnreachable.
    """
    from h3serve.client import GatewayClient, describe_event

    with GatewayClient(address, root_pem, token) as client:
        client.wait_ready(connect_timeout_s)
        _attach_media(client, request, media)
        progress = Progress(stream)
        final = client.generate(request, progress)
        progress.end()
        if final.WhichOneof("kind") != "done":
            raise SystemExit(f"job {final.job_id} {describe_event(final)}")
        path = client.download(final.done.video.artifact_id, out)
        if raw:
            client.download(final.done.raw.artifact_id, raw)
        return client.job(final.job_id), path


class _OrderedMedia(argparse.Action):
    """Collects --first-frame / --last-frame / --ref-* as (flag, path) pairs in command-line order."""

    def __call__(self, parser, namespace, value, option_string=None):
        namespace.media = [*(getattr(namespace, "media", None) or []), (self.dest, value)]


def _attach_media(client, request, media) -> None:
    from h3serve.v1 import media_pb2

    kinds = {
        "ref_image": media_pb2.ASSET_KIND_IMAGE,
        "ref_video": media_pb2.ASSET_KIND_VIDEO,
        "ref_audio": media_pb2.ASSET_KIND_AUDIO,
    }
    for flag, path in media or []:
        asset = client.upload(path)
        if flag in kinds:
            request.references.add(asset_id=asset.asset_id, kind=kinds[flag])
        else:
            setattr(request, flag, asset.asset_id)


def print_timings(job, path: Path) -> None:
    stages = "  ".join(f"{s.stage} {s.seconds:.2f} s" for s in job.stages)
    print(f"video: {path.resolve()}\nstages: {stages}", flush=True)


def _gateway_address(args) -> str:
    """--gateway; else --config's gateway on this host; else the Python client's default ($H3SERVE_GATEWAY, else
    the local gateway on its default port)."""
    from h3serve.client import default_address

    if args.gateway:
        return args.gateway
    return f"127.0.0.1:{load_deploy(args.config).gateway.port}" if args.config else default_address()


def _generate(args) -> None:
    import grpc

    from h3serve.client import GATEWAY_ENV, GatewayUnreachable

    root_pem = Path(args.ca).read_bytes() if args.ca else None
    try:
        job, path = generate(
            _gateway_address(args),
            _request(args),
            args.out,
            args.raw,
            media=args.media,
            root_pem=root_pem,
            token=args.token,
            connect_timeout_s=args.connect_timeout,
        )
    except GatewayUnreachable as exc:
        tls = "; or not one with a certificate from --ca" if args.ca else ""
        raise SystemExit(f"h3serve generate: {exc} ({GATEWAY_ENV} / --gateway{tls})") from None
    except grpc.RpcError as exc:
        raise SystemExit(f"h3serve generate: {exc.code().name}: {exc.details()}") from None
    print_timings(job, path)


def _reference(args) -> None:
    import numpy as np
    import torch

    from h3serve.cli.reference import ReferenceRequest, resolved_params, run_reference, service_threads
    from h3serve.runtime.models import ModelSource

    config = load_deploy(args.config)
    threads, note = service_threads(config)
    if note:
        print(f"reference: {note}", file=sys.stderr)
    if threads:
        torch.set_num_threads(threads)
    frames = {dest: path for dest, path in args.media if dest in ("first_frame", "last_frame")}
    references = tuple((dest.removeprefix("ref_"), path) for dest, path in args.media if dest.startswith("ref_"))
    try:
        params = resolved_params(config.dit.adapters, _request(args).params, config.gateway.default_steps)
    except ValueError as exc:
        raise SystemExit(f"h3serve reference: {exc}") from None
    source = ModelSource(args.model_dir or config.dit.model_dir or None, config.dit.transformer_file)  # the DiT's file
    result = run_reference(
        source,
        ReferenceRequest(
            args.prompt,
            args.height,
            args.width,
            args.num_frames,
            params.num_inference_steps,
            args.seed,
            references=references,
            adapters=tuple((a.name, a.weight) for a in params.adapters),
            flow_shift=params.flow_shift,
            audio_flow_shift=params.audio_flow_shift,
            **frames,
        ),
        args.device,
        args.dtype,
        config.gateway.geometry,
        config.dit.adapters,
    )
    # numpy's stub matches a ** dict against savez's allow_pickle keyword too; the result has no such key
    np.savez(args.raw, **result)  # type: ignore[arg-type]
    print(f"reference: {Path(args.raw).resolve()}")


def _write_tiny(args) -> None:
    from h3serve.runtime.tiny import write_tiny_model

    print(write_tiny_model(args.directory).resolve())


def _demo(args) -> None:
    """Start everything with the tiny model on CPU, generate one MP4 with sound, stop everything.

    The gateway keeps its jobs in a fresh directory, so the demo neither shows nor leaves jobs in `up`'s data_dir.
    """
    from h3serve.cli.launcher import ServiceGroup

    for signum in (signal.SIGTERM, signal.SIGHUP):  # like Ctrl-C: the group stops its services, gateway first
        signal.signal(signum, signal.default_int_handler)
    work = Path(tempfile.mkdtemp(prefix="h3serve-demo-"))
    log_dir, data_dir = work / "logs", work / "gateway"
    config = load_deploy(args.config)
    started = time.perf_counter()
    with ServiceGroup(config, args.config, str(log_dir), flags={"gateway": ["--data-dir", str(data_dir)]}):
        print(
            f"services healthy in {time.perf_counter() - started:.1f} s (logs in {log_dir}, "
            f"jobs in {data_dir}: a fresh data directory for this demo)",
            flush=True,
        )
        out = Path(args.out or "out")
        out.mkdir(parents=True, exist_ok=True)
        job, path = generate(f"127.0.0.1:{config.gateway.port}", _request(args), out, None)
    print_timings(job, path)


def _capacity(args) -> None:
    """The table (each entry bounded by max_rows too), then max_rows, which bounds every request."""
    from h3serve.gateway.admission.capacity import CapacityTable

    gateway = load_deploy(args.config).gateway
    table = CapacityTable(gateway.capacity, gateway.max_rows)
    rows = table.table(args.text_rows)
    assumed = f"text {args.text_rows} rows, no conditioning"
    if rows:
        print(f"{'workflow':<9} {'canvas':<10} {'max rows':>9}  max frames ({assumed})")
    else:
        print("no capacity table in this deployment ([gateway] capacity): max_rows alone bounds a request")
    for workflow, canvas, limit, frames in rows:
        shown = "-" if canvas == "*" else (frames or "none fit")
        print(f"{workflow:<9} {canvas:<10} {limit:>9,}  {shown}")
    height, width = gateway.geometry.default_canvas
    frames = table.max_frames(gateway.max_rows, height, width, args.text_rows)
    fit = f"at most {frames} frames" if frames else f"no clip, not even {rules.VALID_NUM_FRAMES[0]} frames"
    print(
        f"every request: at most {gateway.max_rows:,} packed rows ([gateway] max_rows); at the default canvas "
        f"{height}x{width}: {fit} ({assumed})"
    )


def _add_request_args(p: argparse.ArgumentParser, steps: int | None, height=None, width=None) -> None:
    p.add_argument("--prompt", default="a red fox trotting through fresh snow, wind in the pines")
    p.add_argument("--height", type=int, default=height, help=generate_help.canvas(height, width))
    p.add_argument("--width", type=int, default=width, help="see --height")
    p.add_argument("--steps", type=int, default=steps, help="num_inference_steps (N gives N-1 denoise steps)")
    p.add_argument(
        "--adapter",
        action="append",
        type=_adapter,
        default=[],
        metavar="NAME[:WEIGHT]",
        help="a LoRA adapter of the DiT's [dit] adapters, weight 1 by default (repeatable, in order)",
    )
    p.add_argument("--flow-shift", type=float, help="the video schedule's shift (default: an adapter's, else 12)")
    p.add_argument("--audio-flow-shift", type=float, help="the audio schedule's shift (default: an adapter's, else 3)")
    p.add_argument(
        "--out",
        help="file or directory for the MP4 (default: h3-<job id>.mp4 in the current directory; the demo uses out/)",
    )


def _adapter(text: str):
    from h3serve.model import adapters

    try:
        return adapters.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_media_args(p: argparse.ArgumentParser) -> None:
    for flag, what in (
        ("first-frame", "fl2va: image the video starts from"),
        ("last-frame", "fl2va: image the video ends on"),
        ("ref-image", "ref2va: an image reference, <Picture i> in the prompt (repeatable)"),
        ("ref-video", "ref2va: a video reference (its sound too), <Video k> (repeatable)"),
        ("ref-audio", "ref2va: an audio reference, <Audio j> (repeatable)"),
    ):
        p.add_argument(f"--{flag}", action=_OrderedMedia, metavar="FILE", help=what)
    p.set_defaults(media=[])


def parser() -> argparse.ArgumentParser:
    from h3serve.client.channel import GATEWAY_ENV, LOCAL_GATEWAY

    root = argparse.ArgumentParser(prog="h3serve", description=__doc__)
    sub = root.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run one service in the foreground")
    p.add_argument("service", choices=[*SERVICES, "gateway"])
    p.add_argument("--config", help="deployment TOML file")
    for flag in ("host", "model-dir", "device", "dtype", "attention-backend", "data-dir"):
        p.add_argument(f"--{flag}")
    p.add_argument("--port", type=int)
    p.add_argument("--world-size", type=int, help="dit: ranks in the sharded group, started by its launcher")
    p.set_defaults(run=_serve)

    p = sub.add_parser("up", help="start encoder, dit, vae and gateway; Ctrl-C stops them")
    p.add_argument("--config")
    p.add_argument("--log-dir", help="write each service's log here instead of the terminal (created if missing)")
    p.set_defaults(run=_up)

    p = sub.add_parser("generate", help="generate one video through the gateway")
    p.add_argument(
        "--gateway",
        metavar="HOST:PORT",
        help=f"default: with --config, that deployment's gateway on this "
        f"host; else ${GATEWAY_ENV}, else {LOCAL_GATEWAY}",
    )
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=CONNECT_TIMEOUT_S,
        metavar="SECONDS",
        help="give up when the gateway does not answer within this time (default %(default)g)",
    )
    p.add_argument("--config")
    _add_request_args(p, steps=None)
    p.add_argument("--num-frames", type=int, help=generate_help.num_frames())
    p.add_argument("--seconds", type=float, help=generate_help.seconds())
    p.add_argument("--seed", type=int)
    p.add_argument("--raw", help="also save decoded frames + waveform (.npz) for comparison")
    p.add_argument(
        "--request-id",
        help="idempotency key: running the command again with it re-attaches to the "
        "same job instead of starting another",
    )
    p.add_argument("--ca", metavar="FILE", help="PEM root certificate of a gateway that serves TLS")
    p.add_argument(
        "--token",
        default=os.environ.get("H3SERVE_TOKEN"),
        help="bearer token the gateway requires (default: $H3SERVE_TOKEN)",
    )
    _add_media_args(p)
    p.set_defaults(run=_generate)

    p = sub.add_parser("reference", help="run diffusers' in-process pipeline; writes the same .npz as --raw")
    p.add_argument(
        "--model-dir", help="diffusers model directory (default: --config's [model] dir, else the tiny preset)"
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    _add_request_args(p, steps=None)  # unset: an adapter's recommendation, else the deployment's default_steps
    p.add_argument("--num-frames", type=int, default=rules.DEFAULT_NUM_FRAMES, help=generate_help.num_frames())
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--raw", required=True)
    p.add_argument(
        "--config",
        help="deployment TOML: its [model] dir and pipeline configs (geometry), and the "
        "model services' threads, so the bytes match the served ones",
    )
    _add_media_args(p)
    p.set_defaults(run=_reference)

    p = sub.add_parser("write-tiny", help="save the built-in tiny model in the released diffusers layout")
    p.add_argument("directory")
    p.set_defaults(run=_write_tiny)

    p = sub.add_parser("capacity", help="print the deployment's admission table: max rows and frames per canvas")
    p.add_argument("--config")
    p.add_argument("--text-rows", type=int, default=256, help="prompt rows assumed for the frame ceiling")
    p.set_defaults(run=_capacity)

    p = sub.add_parser("demo", help="up + one generation with the tiny model + stop")
    p.add_argument("--config")
    _add_request_args(p, steps=8, height=64, width=128)
    p.set_defaults(run=_demo)

    plan.add_parser(sub)
    experiment.add_parser(sub)
    return root


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        args.run(args)
    except ConfigError as exc:  # a refused deployment file or flag: its reasons, not a traceback
        raise SystemExit(f"h3serve {args.command}: {exc}") from None


if __name__ == "__main__":
    main()
