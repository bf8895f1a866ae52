"""A finished clip waits for space (issue 51): the artifacts' disk fills while jobs are in flight; each finished clip
waits (its `waiting` event names the directory, the space free there and what it needs), is written once the disk has
room again, and every job SUCCEEDED with its video whole; past [gateway] artifact_space_wait_s the job fails naming
the disk, leaving no partial file, and the next one succeeds once there is room. Real processes: a gateway of its own,
its artifacts on a small tmpfs the test mounts, on the session stack's encoder, DiT and VAE (its DiT holds the first
job mid-denoise while the disk fills)."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import HELD, free_port, write_config
from test_disk_full import NO_SPACE, fill, full, tmpfs

from h3serve.cli.launcher import ServiceGroup
from h3serve.client import GatewayClient, is_terminal
from h3serve.common.config import load_deploy
from h3serve.common.disk import MARK
from h3serve.gateway.jobs.runner import ARTIFACTS_STAGE
from h3serve.v1 import gateway_pb2

pytestmark = pytest.mark.processes

S = gateway_pb2
JOBS = 3


@contextmanager
def gateway_on_small_disk(stack, tmp_path: Path, **gateway) -> Iterator[tuple[GatewayClient, Path]]:
    """A gateway of its own on the stack's stages, its artifacts on a 1 MiB tmpfs: its client and the disk."""
    data_dir, port = tmp_path / "gateway", free_port()
    ports = {**{name: stack.ports[name] for name in ("encoder", "dit", "vae")}, "gateway": port}
    config = write_config(tmp_path / "deploy.toml", str(stack.model_dir), data_dir, ports, **gateway)
    with (
        tmpfs(data_dir / "artifacts", size_mib=1) as disk,
        ServiceGroup(load_deploy(config), str(config), log_dir=str(tmp_path), names=("gateway",)),
        GatewayClient(f"127.0.0.1:{port}") as client,
    ):
        yield client, disk


def _end(client: GatewayClient, job_id: str) -> gateway_pb2.JobEvent:
    return next(event for event in client.events(job_id) if is_terminal(event))


def _waiting(client: GatewayClient, job_id: str) -> gateway_pb2.Waiting:
    return next(event.waiting for event in client.events(job_id) if event.HasField("waiting"))


def _says_where_and_how_much(waiting: gateway_pb2.Waiting, disk: Path) -> bool:
    return waiting.stage == ARTIFACTS_STAGE and bool(
        re.fullmatch(
            rf"{MARK}: {disk} \(\d+ bytes free of 1\.0 MiB on the file system mounted at {disk}\): "
            r"\d+(\.\d KiB| bytes) needed",
            waiting.reason,
        )
    )


def test_a_disk_filled_under_running_jobs_and_freed_loses_no_job(stack, dit_hold, tmp_path):
    with gateway_on_small_disk(stack, tmp_path) as (client, disk):
        with dit_hold.armed():
            jobs = [client.submit(S.GenerateRequest(prompt=f"a fox, take {i}", **HELD)) for i in range(JOBS)]
            next(event for event in client.events(jobs[0].job_id) if dit_hold.holds(event))
            filler = fill(disk)  # while the first is mid-denoise and the others wait for the DiT
        waiting = _waiting(client, jobs[0].job_id)
        assert _says_where_and_how_much(waiting, disk) and waiting.limit_s == 1800.0, waiting  # the default wait

        filler.unlink()
        ends = [_end(client, job.job_id) for job in jobs]
        assert [end.WhichOneof("kind") for end in ends] == ["done"] * JOBS
        for end in ends:
            video = client.download(end.done.video.artifact_id, tmp_path / "videos")
            assert hashlib.sha256(video.read_bytes()).hexdigest() == end.done.video.sha256
        assert [client.job(job.job_id).state for job in jobs] == [S.JOB_STATE_SUCCEEDED] * JOBS


def test_past_its_wait_a_clip_fails_naming_the_disk_and_the_next_succeeds(stack, tmp_path):
    with gateway_on_small_disk(stack, tmp_path, artifact_space_wait_s=2.0) as (client, disk):
        filler = fill(disk)
        job = client.submit(S.GenerateRequest(prompt="no room for its video", **HELD))
        waiting = _waiting(client, job.job_id)
        assert _says_where_and_how_much(waiting, disk) and waiting.limit_s == 2.0, waiting
        end = _end(client, job.job_id)
        assert (end.failed.code_name, end.failed.message) == ("RESOURCE_EXHAUSTED", full(disk, disk, NO_SPACE, 1))
        assert not client.job(job.job_id).artifacts and os.listdir(disk) == ["filler"], "no partial video is left"

        filler.unlink()
        assert _end(client, client.submit(S.GenerateRequest(prompt="room again", **HELD)).job_id).HasField("done")
