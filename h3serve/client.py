"""A small synchronous client of the public API: generate with live events, download artifacts."""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable
from pathlib import Path

import grpc

from h3serve.common.server import GRPC_OPTIONS
from h3serve.v1 import gateway_pb2, gateway_pb2_grpc


class _CallDetails(namedtuple("_CallDetails", "method timeout metadata credentials wait_for_ready compression"),
                   grpc.ClientCallDetails):
    pass


class BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                  grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer <token>` to every call (metadata, so it also works without TLS)."""

    def __init__(self, token: str) -> None:
        self.header = ("authorization", f"Bearer {token}")

    def _call(self, continuation, details, request):
        metadata = [*(details.metadata or ()), self.header]
        return continuation(_CallDetails(details.method, details.timeout, metadata, details.credentials,
                                         details.wait_for_ready, details.compression), request)

    intercept_unary_unary = intercept_unary_stream = intercept_stream_unary = intercept_stream_stream = _call


class GatewayClient:
    """`root_pem`: PEM root certificate(s) of a gateway that serves TLS (None: plaintext); `token`: the bearer
    token it requires (None or empty: none sent)."""

    def __init__(self, address: str, root_pem: bytes | None = None, token: str | None = None) -> None:
        if root_pem is None:
            self.channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        else:
            self.channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_pem), options=GRPC_OPTIONS)
        if token:
            self.channel = grpc.intercept_channel(self.channel, BearerToken(token))
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def generate(self, request: gateway_pb2.GenerateRequest,
                 on_event: Callable[[gateway_pb2.JobEvent], None] = lambda e: None) -> gateway_pb2.JobEvent:
        """Run one generation; returns its terminal event (done, failed or cancelled)."""
        last = None
        for event in self.stub.Generate(request, wait_for_ready=True):
            on_event(event)
            last = event
        return last

    def upload(self, path: str | Path, chunk_bytes: int = 1 << 20) -> gateway_pb2.Asset:
        """Upload one image, video or audio file; returns the stored asset (the same id for the same bytes)."""
        def chunks():
            with open(path, "rb") as file:
                first = True
                while (data := file.read(chunk_bytes)) or first:
                    yield gateway_pb2.UploadAssetChunk(file_name=Path(path).name if first else "", data=data)
                    first = False

        return self.stub.UploadAsset(chunks(), wait_for_ready=True)

    def job(self, job_id: str) -> gateway_pb2.Job:
        return self.stub.GetJob(gateway_pb2.GetJobRequest(job_id=job_id))

    def download(self, artifact_id: str, path: str | Path | None = None) -> Path:
        """Save an artifact; `path` is a file, or a directory for the server's file name (default: cwd)."""
        stream = self.stub.DownloadArtifact(gateway_pb2.DownloadArtifactRequest(artifact_id=artifact_id))
        first = next(stream)
        target = Path(path or ".")
        if target.is_dir():
            target = target / first.file_name
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as file:
            file.write(first.data)
            for chunk in stream:
                file.write(chunk.data)
        return target


def _accepted(event: gateway_pb2.JobEvent) -> str:
    r = event.accepted.request
    return (f"accepted {event.job_id}: {r.height}x{r.width}, {r.num_frames} frames, "
            f"{r.params.num_inference_steps} steps, seed {r.params.seed}")


def _denoising(event: gateway_pb2.JobEvent) -> str:
    d = event.denoising
    return (f"denoising step {d.step}/{d.total}  {d.step_seconds:.2f} s/step  "
            f"elapsed {d.elapsed_seconds:.1f} s  eta {d.eta_seconds:.1f} s")


_LINES = {
    "accepted": _accepted,
    "conditioning": lambda e: f"encoding keyframes / references: encoder call {e.conditioning.done}/"
                              f"{e.conditioning.total}",
    "encoding": lambda e: f"encoded ({'cache hit' if e.encoding.cache_hit else 'cache miss'}) in "
                          f"{e.encoding.seconds:.2f} s",
    "denoising": _denoising,
    "decoding": lambda e: f"decoding {e.decoding.chunk}/{e.decoding.total}",
    "muxing": lambda e: f"muxing {e.muxing.done}/{e.muxing.total} s",
    "retrying": lambda e: f"retrying: attempt {e.retrying.attempt}/{e.retrying.max_attempts}: {e.retrying.reason}",
    "done": lambda e: f"done: {e.done.video.file_name} ({e.done.video.bytes} bytes, {e.done.duration_s:.2f} s)",
    "failed": lambda e: f"failed: {e.failed.code_name}: {e.failed.message}",
    "cancelled": lambda e: f"cancelled: {e.cancelled.reason}",
}


def describe_event(event: gateway_pb2.JobEvent) -> str:
    """One human line per event, for the CLI's progress display."""
    return _LINES[event.WhichOneof("kind")](event)
