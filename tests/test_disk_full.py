"""A full disk under the gateway's data_dir (issue 29): uploads and jobs are refused RESOURCE_EXHAUSTED naming the disk
(HTTP 507, never retried), nothing is left half-written, no job stays running without a worker, and the same gateway
carries on once space returns. The disk is a small tmpfs the test mounts (we run as root) and fills with a file."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import grpc
import openai
import pytest
from deployments import write_config
from up_process import eventually

from bench.media_files import image
from h3serve.cli.launcher import ServiceGroup
from h3serve.client import GatewayClient
from h3serve.common.config import GatewayConfig, load_deploy
from h3serve.common.disk import MARK, DiskFull
from h3serve.common.free_ports import free_port
from h3serve.common.processes import EXIT_REFUSED
from h3serve.common.server import is_answering
from h3serve.gateway.assets.store import AssetStore
from h3serve.gateway.assets.validate import AssetLimits
from h3serve.gateway.blobs import DirectoryBlobs
from h3serve.gateway.jobs.artifacts import ArtifactStore
from h3serve.gateway.jobs.events import EventHub
from h3serve.gateway.jobs.retention import Retention
from h3serve.gateway.jobs.runner import JobRunner
from h3serve.gateway.jobs.sqlite import SqliteJobStore
from h3serve.gateway.metrics import GatewayMetrics
from h3serve.gateway.stages import STAGE_NAMES
from h3serve.gateway.stages.calls import StageCaller
from h3serve.v1 import gateway_pb2

pytestmark = pytest.mark.processes

S = gateway_pb2
DISK_MIB = 8
REQUEST = S.ResolvedRequest(prompt="a fox", height=32, width=64, num_frames=124)
SMALL = dict(height=32, width=64, num_inference_steps=8)
NO_SPACE, SQLITE_FULL = "No space left on device", "database or disk is full"
MULTIPART = {"Content-Type": "multipart/form-data"}  # the SDK then sends its files as a form (its own uploads do)


@contextmanager
def tmpfs(directory: Path, size_mib: int = DISK_MIB) -> Iterator[Path]:
    """A small file system of `size_mib` mounted on `directory` for the block."""
    if os.geteuid() != 0:
        pytest.skip("a full disk is a small tmpfs here, and mounting one needs root")
    directory.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(directory)], capture_output=True, text=True
    )
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", str(directory)], check=True)


@pytest.fixture
def disk(tmp_path) -> Iterator[Path]:
    with tmpfs(tmp_path / "disk") as mounted:
        yield mounted


def fill(disk: Path) -> Path:
    """A file that takes every free byte of `disk`."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as file, pytest.raises(OSError) as ended:
        while True:
            file.write(bytes(1 << 16))
    assert ended.value.errno == errno.ENOSPC
    return filler


def full(directory: Path, mount: Path, reason: str, size_mib: int = DISK_MIB) -> str:
    """The message of a write under `directory` that the full disk mounted at `mount` refused."""
    return (
        f"{MARK}: {directory} (0 bytes free of {size_mib:.1f} MiB on the file system mounted at {mount}): {reason}; "
        "free space there and try again"
    )


# In process: the gateway's parts on the small disk.


def test_an_artifact_the_disk_cannot_hold_leaves_no_part_and_retention_still_frees_space(disk):
    data = disk / "data"

    async def scenario():
        store, artifacts = SqliteJobStore(str(data / "jobs.sqlite")), ArtifactStore(DirectoryBlobs(str(data)))
        old, old_path = artifacts.save("old", "video", bytes(256 << 10))
        await store.submit("old", REQUEST)
        await store.add_artifact("old", "video", old, old_path)
        filler = fill(disk)

        with pytest.raises(DiskFull) as refused:
            artifacts.save("new", "video", bytes(1 << 20))
        assert str(refused.value) == full(data / "artifacts", disk, NO_SPACE)
        assert os.listdir(data / "artifacts") == [old.file_name], "the partial file is removed"

        # The store cannot record the removal before the file has made room for it: the file goes first.
        assert await Retention(store, artifacts, max_age_s=1.0).enforce(now=time.time() + 60) == ["old-video"]
        assert os.listdir(data / "artifacts") == [] and await store.artifacts_oldest_first() == []

        filler.unlink()
        assert artifacts.save("new", "video", b"room again")[0].bytes == len(b"room again")
        await store.close()

    asyncio.run(scenario())


def test_a_job_the_full_disk_fails_keeps_its_worker_until_its_end_is_recorded(disk, caplog):
    """Not even the job's end fits on the disk: the job stays with its task, which records the end once space
    returns, instead of a job left running that nothing runs."""
    data = disk / "data"
    caplog.set_level(logging.WARNING, logger="h3serve.gateway.jobs")

    async def scenario():
        store, config, metrics = SqliteJobStore(str(data / "jobs.sqlite")), GatewayConfig(), GatewayMetrics(STAGE_NAMES)
        hub = EventHub(store)
        blobs = DirectoryBlobs(str(data))
        assets = AssetStore(blobs, str(data / "assets"), AssetLimits())
        runner = JobRunner(config, store, hub, StageCaller(config, metrics), ArtifactStore(blobs), metrics, assets)
        await store.submit("no-room", REQUEST, first_event=S.JobEvent(accepted=S.Accepted()))
        filler = fill(disk)
        runner.start("no-room", REQUEST)
        while "job no-room: its end waits for space on the disk" not in caplog.text:
            await asyncio.sleep(0.05)
        job = await store.get_job("no-room")
        assert job.state == S.JOB_STATE_QUEUED and job.attempts == 0, "its attempt was rolled back whole"
        assert [event.WhichOneof("kind") for event in await store.events("no-room")] == ["accepted"]

        filler.unlink()
        events = [event async for event in hub.watch("no-room")]
        reason = full(data, disk, SQLITE_FULL)
        assert events[-1].failed == S.Failed(
            code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], code_name="RESOURCE_EXHAUSTED", message=reason
        )
        job = await store.get_job("no-room")
        assert (job.state, job.error.message) == (S.JOB_STATE_FAILED, reason)
        await runner.caller.close()
        await store.close()

    asyncio.run(scenario())


# Real processes: the gateway alone (its stages down), then the whole tiny stack.


def _chunks(path: Path) -> Iterator[gateway_pb2.UploadAssetChunk]:
    data = path.read_bytes()
    for offset in range(0, len(data), 64 << 10):
        yield S.UploadAssetChunk(file_name=path.name if offset == 0 else "", data=data[offset : offset + (64 << 10)])


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _stored_jobs(path: Path) -> dict[str, tuple[int, list[str]]]:
    """Every job of the store file, read by a connection of the test's own: its state and its events' kinds, each
    request and event parsed, the events numbered 1..last_seq."""
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
        assert db.execute("PRAGMA quick_check").fetchall() == [("ok",)]
        jobs = {}
        for job_id, state, request, last_seq in db.execute("SELECT job_id, state, request, last_seq FROM jobs"):
            S.ResolvedRequest.FromString(request)
            rows = db.execute("SELECT event FROM events WHERE job_id = ? ORDER BY seq", (job_id,)).fetchall()
            events = [S.JobEvent.FromString(blob) for (blob,) in rows]
            assert [event.seq for event in events] == list(range(1, last_seq + 1)), job_id
            jobs[job_id] = (state, [event.WhichOneof("kind") for event in events])
    return jobs


class Door:
    """The HTTP door through OpenAI's SDK, which would retry three times; `sent` counts what it actually sent."""

    def __init__(self, port: int) -> None:
        self.sent: list = []
        self.http = openai.DefaultHttpxClient(event_hooks={"request": [self.sent.append]})
        self.sdk = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=3, http_client=self.http
        )

    def close(self) -> None:
        self.sdk.close()

    def upload(self, name: str, data: bytes) -> dict:
        """POST /v1/assets (h3serve's upload: a multipart file)."""
        return self.sdk.post(
            "/assets", cast_to=object, files=[("file", (name, data))], options={"headers": MULTIPART}, body={}
        )

    def create(self, prompt: str) -> openai.types.Video:
        return self.sdk.videos.create(prompt=prompt, size="64x32")

    def delete(self, video_id: str) -> openai.types.VideoDeleteResponse:
        return self.sdk.videos.delete(video_id)

    def refused(self, call, *args) -> openai.InternalServerError:
        """The door's refusal of `call(*args)`, sent once: a 5xx the SDK was told not to retry."""
        before = len(self.sent)
        with pytest.raises(openai.InternalServerError) as caught:
            call(*args)
        assert len(self.sent) == before + 1 and caught.value.response.headers["x-should-retry"] == "false"
        return caught.value


@pytest.mark.gateway
def test_a_full_disk_refuses_uploads_and_jobs_naming_it_and_the_gateway_carries_on(disk, tmp_path, monkeypatch):
    data_dir, spool = disk / "gateway", disk / "spool"
    spool.mkdir()
    monkeypatch.setenv("TMPDIR", str(spool))  # where the HTTP door spools a file part over 1 MiB
    ports = {name: free_port() for name in ("encoder", "dit", "vae", "gateway", "http")}
    config = write_config(tmp_path / "deploy.toml", "", data_dir, ports, http_port=ports["http"])
    pictures = [image(tmp_path / f"{i}.png", 48, 32, seed=i) for i in range(3)]
    large = image(tmp_path / "large.png", 700, 700).read_bytes()  # 1.4 MB of noise: the door spools it to disk
    with (
        ServiceGroup(load_deploy(config), str(config), log_dir=str(tmp_path), names=("gateway",), ready=is_answering),
        GatewayClient(f"127.0.0.1:{ports['gateway']}") as client,
        closing(Door(ports["http"])) as door,
    ):
        waiting = client.stub.Submit(S.GenerateRequest(prompt="waits for its stages", **SMALL))
        kinds = []
        for event in client.stub.Watch(S.WatchRequest(job_id=waiting.job_id)):
            kinds.append(event.WhichOneof("kind"))
            if event.HasField("waiting"):
                break  # its encoder is down: it waits in the stage and writes nothing until the stage returns
        stored = client.stub.UploadAsset(_chunks(pictures[0]))
        # (the door's first form also settles its temporary directory, which Python picks while it can write there)
        assert door.upload("large.png", large)["id"] == _sha256(large)
        ended = client.stub.Submit(S.GenerateRequest(prompt="cancelled before the disk fills", **SMALL))
        assert client.stub.CancelJob(S.CancelJobRequest(job_id=ended.job_id)).state == S.JOB_STATE_CANCELLED
        before = _stored_jobs(data_dir / "jobs.sqlite")
        filler = fill(disk)

        for call, directory, reason in (
            (lambda: client.stub.UploadAsset(_chunks(pictures[1])), data_dir / "assets", NO_SPACE),
            (lambda: client.stub.Submit(S.GenerateRequest(prompt="no room", **SMALL)), data_dir, SQLITE_FULL),
            # a call with no handler of its own for it (the guard's): the bin is a write too
            (lambda: client.stub.DeleteJob(S.DeleteJobRequest(job_id=ended.job_id)), data_dir, SQLITE_FULL),
            # the job stops, but its end cannot be written: said at once (twice), not after the space returns
            (
                lambda: client.stub.CancelJob(S.CancelJobRequest(job_id=waiting.job_id), timeout=60),
                data_dir,
                SQLITE_FULL,
            ),
            (
                lambda: client.stub.CancelJob(S.CancelJobRequest(job_id=waiting.job_id), timeout=60),
                data_dir,
                SQLITE_FULL,
            ),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert (refused.value.code(), refused.value.details()) == (
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                full(directory, disk, reason),
            )
        for refused, directory, reason in (
            (door.refused(door.upload, pictures[1].name, pictures[1].read_bytes()), data_dir / "assets", NO_SPACE),
            (door.refused(door.upload, "other.png", large + b"other"), spool, NO_SPACE),  # the door's own spool
            (door.refused(door.create, "no room"), data_dir, SQLITE_FULL),
            (door.refused(door.delete, ended.job_id), data_dir, SQLITE_FULL),
        ):
            assert (refused.status_code, refused.body) == (
                507,
                {
                    "message": full(directory, disk, reason),
                    "type": "server_error",
                    "param": None,
                    "code": "resource_exhausted",
                },
            )

        # Nothing half-written: no upload's part, and the store holds the job from before and nothing else.
        assert os.listdir(data_dir / "assets" / "tmp") == []
        assert sorted(os.listdir(data_dir / "assets" / "blobs")) == sorted([stored.asset_id, _sha256(large)])
        assert (
            _stored_jobs(data_dir / "jobs.sqlite")
            == before
            == {
                waiting.job_id: (S.JOB_STATE_RUNNING, kinds),
                ended.job_id: (S.JOB_STATE_CANCELLED, ["accepted", "cancelled"]),
            }
        )

        filler.unlink()
        # The same gateway carries on: uploads and jobs succeed, and the cancelled job's worker records its end.
        assert client.stub.UploadAsset(_chunks(pictures[1])).asset_id == _sha256(pictures[1].read_bytes())
        assert door.upload(pictures[2].name, pictures[2].read_bytes())["id"] == _sha256(pictures[2].read_bytes())
        accepted = client.stub.Submit(S.GenerateRequest(prompt="room again", **SMALL))
        assert client.job(accepted.job_id).state in (S.JOB_STATE_QUEUED, S.JOB_STATE_RUNNING)
        assert door.create("room again, over HTTP").status in ("queued", "in_progress")
        # its worker tries again every DISK_RETRY_S (2 s): until then a cancel still hears the full disk
        assert eventually(lambda: client.job(waiting.job_id).state == S.JOB_STATE_CANCELLED, 30)
        assert client.stub.CancelJob(S.CancelJobRequest(job_id=waiting.job_id)).state == S.JOB_STATE_CANCELLED
        assert _stored_jobs(data_dir / "jobs.sqlite")[waiting.job_id] == (S.JOB_STATE_CANCELLED, [*kinds, "cancelled"])


def test_a_gateway_started_on_a_full_disk_is_refused_naming_it_and_starts_once_there_is_room(disk, tmp_path):
    port = free_port()
    config = write_config(tmp_path / "deploy.toml", "", disk / "gateway", dict(encoder=1, dit=2, vae=3, gateway=port))
    filler = fill(disk)
    serve = [sys.executable, "-m", "h3serve.cli", "serve", "gateway", "--config", str(config)]
    refused = subprocess.run(serve, capture_output=True, text=True, timeout=120)
    assert refused.returncode == EXIT_REFUSED, refused.stderr  # `up` does not restart it: space comes from a person
    assert refused.stderr.splitlines()[-1] == f"refused: [gateway] data_dir {full(disk / 'gateway', disk, NO_SPACE)}"
    assert "Traceback" not in refused.stderr

    filler.unlink()
    with (
        ServiceGroup(load_deploy(config), str(config), log_dir=str(tmp_path), names=("gateway",), ready=is_answering),
        GatewayClient(f"127.0.0.1:{port}") as client,
    ):
        assert list(client.stub.ListJobs(S.ListJobsRequest()).jobs) == []
