"""`GatewayClient`: the public API (h3serve.v1.Gateway) as typed Python calls, retried where that is safe."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import grpc

from h3serve.client.channel import default_address, open_channel
from h3serve.client.events import is_terminal
from h3serve.client.retry import RetryPolicy
from h3serve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

EventCallback = Callable[[gateway_pb2.JobEvent], None]


class GatewayUnreachable(ConnectionError):
    """Nothing at the address completed a connection in time: no gateway there, or (TLS) not one that `root_pem`
    vouches for."""

    def __init__(self, address: str, timeout_s: float) -> None:
        self.address, self.timeout_s = address, timeout_s
        super().__init__(f"no h3serve gateway answers at {address} within {timeout_s:g} s")


def _chunks(path: Path, chunk_bytes: int) -> Iterator[gateway_pb2.UploadAssetChunk]:
    """The file's bytes in order, its name with the first chunk (an empty file still sends one)."""
    with open(path, "rb") as file:
        first = True
        while (data := file.read(chunk_bytes)) or first:
            yield gateway_pb2.UploadAssetChunk(file_name=path.name if first else "", data=data)
            first = False


def _save(stream: Iterator[gateway_pb2.ArtifactChunk], path: Path) -> Path:
    """Write a DownloadArtifact stream to `path`, a file or a directory for the server's file name."""
    first = next(stream)
    target = path / first.file_name if path.is_dir() else path
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "wb") as file:
        file.write(first.data)
        for chunk in stream:
            file.write(chunk.data)
    return target


class GatewayClient:
    """A synchronous client of one gateway. `address`: host:port (None: `default_address()`, $H3SERVE_GATEWAY else
    127.0.0.1:50050); `root_pem`: PEM root certificate(s) of a gateway that serves TLS (None: plaintext); `token`:
    the bearer token it requires (None or empty: none sent); `retry`: how calls that meet UNAVAILABLE (the gateway
    restarting) or a full queue (RESOURCE_EXHAUSTED with a retry time, waited out) are tried again. Every call is
    safe to repeat: reads, idempotent writes, and Submit with a request_id. `stub` is the generated stub on the same
    channel (TLS and token included), for the RPCs themselves. A context manager; or call `close()`."""

    def __init__(
        self,
        address: str | None = None,
        root_pem: bytes | None = None,
        token: str | None = None,
        retry: RetryPolicy = RetryPolicy(),
    ) -> None:
        self.address = address or default_address()
        self.retry = retry
        self.channel = open_channel(self.address, root_pem, token)
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait_ready(self, timeout_s: float) -> None:
        """Connect now, or raise GatewayUnreachable after `timeout_s`: a wrong address fails at once with its name
        instead of after the retry policy's back-off (about 24 s by default)."""
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise GatewayUnreachable(self.address, timeout_s) from None

    def _call(self, method: Callable, request):
        return self.retry.call(lambda: method(request))

    def submit(self, request: gateway_pb2.GenerateRequest) -> gateway_pb2.Job:
        """Validate, admit and persist one generation; returns the job, queued. A request without a request_id is
        sent with a fresh one (the caller's message is left unchanged), so that a retry after a lost reply or a
        full queue returns the same job instead of starting a second one."""
        sent = gateway_pb2.GenerateRequest()
        sent.CopyFrom(request)
        sent.request_id = request.request_id or uuid.uuid4().hex
        return self._call(self.stub.Submit, sent)

    def events(self, job_id: str, after_seq: int = 0) -> Iterator[gateway_pb2.JobEvent]:
        """Every event of the job after `after_seq`, the stored ones first, until its terminal one. When the stream
        breaks (a gateway restart), it is attached again after the last event seen, so each event comes exactly
        once; the retry policy's back-off starts over with every event received."""
        delays = self.retry.delays()
        while True:
            stream = self.stub.Watch(gateway_pb2.WatchRequest(job_id=job_id, after_seq=after_seq))
            try:
                for event in stream:
                    after_seq, delays = event.seq, self.retry.delays()
                    yield event
                    if is_terminal(event):
                        return
            except grpc.RpcError as error:
                self.retry.backoff(error, delays)
            finally:
                stream.cancel()  # a caller that stops early ends the call

    def generate(
        self, request: gateway_pb2.GenerateRequest, on_event: EventCallback | None = None
    ) -> gateway_pb2.JobEvent:
        """Submit one generation and follow it to its end; returns its terminal event (done, failed or cancelled).
        `on_event` sees every event once, in order, also across a gateway restart."""
        for event in self.events(self.submit(request).job_id):
            if on_event:
                on_event(event)
        return event

    def upload(self, path: str | Path, chunk_bytes: int = 1 << 20) -> gateway_pb2.Asset:
        """Upload one image, video or audio file; returns the stored asset (the same id for the same bytes)."""
        return self.retry.call(lambda: self.stub.UploadAsset(_chunks(Path(path), chunk_bytes)))

    def job(self, job_id: str) -> gateway_pb2.Job:
        return self._call(self.stub.GetJob, gateway_pb2.GetJobRequest(job_id=job_id))

    def jobs(
        self,
        states: Iterable[gateway_pb2.JobState] = (),
        page_size: int = 100,
        deleted: bool = False,
        oldest_first: bool = False,
        after_job_id: str = "",
    ) -> Iterator[gateway_pb2.Job]:
        """Every job, newest first (or `oldest_first`), optionally only those in `states`; those outside the bin, or
        (`deleted`) those in it; from the job after `after_job_id` (empty: from the first). All pages, `page_size`
        jobs per call."""
        request = gateway_pb2.ListJobsRequest(
            states=states, page_size=page_size, deleted=deleted, oldest_first=oldest_first, after_job_id=after_job_id
        )
        while True:
            page = self._call(self.stub.ListJobs, request)
            yield from page.jobs
            if not page.next_page_token:
                return
            request.after_job_id, request.page_token = "", page.next_page_token  # the token alone continues

    def cancel(self, job_id: str) -> gateway_pb2.Job:
        """Cancel a queued or running job; returns it once it has ended (a finished job: as it is)."""
        return self._call(self.stub.CancelJob, gateway_pb2.CancelJobRequest(job_id=job_id))

    def delete(self, job_id: str) -> gateway_pb2.Job:
        """Move a job to the bin, cancelling it first if it is queued or running; returns it (`deleted` set). It
        leaves `jobs()`'s default listing; `job`, `events` and `download` still work."""
        return self._call(self.stub.DeleteJob, gateway_pb2.DeleteJobRequest(job_id=job_id))

    def restore(self, job_id: str) -> gateway_pb2.Job:
        """Take a job out of the bin; returns it (a job its deletion cancelled stays cancelled)."""
        return self._call(self.stub.RestoreJob, gateway_pb2.RestoreJobRequest(job_id=job_id))

    def download(self, artifact_id: str, path: str | Path | None = None) -> Path:
        """Save an artifact; `path` is a file, or a directory for the server's file name (default: cwd)."""
        request = gateway_pb2.DownloadArtifactRequest(artifact_id=artifact_id)
        return self.retry.call(lambda: _save(self.stub.DownloadArtifact(request), Path(path or ".")))

    def info(self) -> gateway_pb2.GatewayInfo:
        """Each stage's replicas, queue depth and workers; the job queue's depth and bound."""
        return self._call(self.stub.Info, common_pb2.InfoRequest())
