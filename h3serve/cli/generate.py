"""`h3serve generate`: one clip through a running gateway, its progress on the terminal, the MP4 (and optionally the
raw frames and waveform) saved here."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from h3serve.cli import generate_help
from h3serve.cli.request_flags import add_media_args, add_request_args, request
from h3serve.common.config import load_deploy

CONNECT_TIMEOUT_S = 10.0  # how long `generate` waits for the gateway to answer before saying nobody does


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

    `media` (keyframe / reference files, see `_attach_media`) are uploaded first and the request refers to them by
    id. `root_pem` and `token` reach a gateway that serves TLS and requires a bearer token. The client submits, then
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


def _attach_media(client, request, media) -> None:
    """Upload each (flag, path) of `media` and refer to it from `request`: a keyframe by its field, a reference in
    order."""
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


def checked_request(args):
    """The request the flags describe, refused here when it breaks a rule the gateway would refuse it for whatever
    it serves (h3serve/gateway/admission/request.py:check_fields): with --config, under that deployment's limits,
    else the shipped defaults'. A request that can never succeed is not sent."""
    from h3serve.gateway.admission.request import RequestLimits, check_fields
    from h3serve.model.rules import InvalidRequest

    made = request(args)
    limits = RequestLimits.from_config(load_deploy(args.config).gateway) if args.config else RequestLimits()
    try:
        check_fields(made, limits)
    except InvalidRequest as exc:
        whose = f"the limits of {args.config}" if args.config else "the shipped limits; --config names a deployment's"
        raise SystemExit(f"h3serve generate: not sent: {exc} ({whose})") from None
    return made


def _run(args) -> None:
    import grpc

    from h3serve.client import GATEWAY_ENV, GatewayUnreachable

    root_pem = Path(args.ca).read_bytes() if args.ca else None
    made = checked_request(args)
    try:
        job, path = generate(
            _gateway_address(args),
            made,
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


def add_parser(subparsers) -> None:
    from h3serve.client.channel import GATEWAY_ENV, LOCAL_GATEWAY

    p = subparsers.add_parser("generate", help="generate one video through the gateway")
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
    add_request_args(p, steps=None)
    p.add_argument("--num-frames", type=int, help=generate_help.num_frames())
    p.add_argument("--seconds", type=float, help=generate_help.seconds())
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
    add_media_args(p)
    p.set_defaults(run=_run)
