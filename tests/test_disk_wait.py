"""A finished clip waits for space (issue 51): the artifacts' disk fills while jobs are in flight; each finished clip
waits (its `waiting` event names the directory, the space free there and what it needs), is written once the disk has
room again, and every job SUCCEEDED with its video whole. Real processes: a gateway of its own, its artifacts on a
small tmpfs the test mounts, on the session stack's encoder, DiT and VAE (its DiT holds the first job mid-denoise
while the disk fills)."""

from __future__ import annotations

import hashlib
import re

import pytest
from conftest import HELD, free_port, write_config
from test_disk_full import fill, tmpfs

from h3serve.cli.launcher import ServiceGroup
from h3serve.client import GatewayClient, is_terminal
from h3serve.common.config import load_deploy
from h3serve.common.disk import MARK
from h3serve.gateway.jobs.runner import ARTIFACTS_STAGE
from h3serve.v1 import gateway_pb2

pytestmark = pytest.mark.processes

S = gateway_pb2
JOBS = 3


def test_a_disk_filled_under_running_jobs_and_freed_loses_no_job(stack, dit_hold, tmp_path):
    data_dir = tmp_path / "gateway"
    port = free_port()
    ports = {**{name: stack.ports[name] for name in ("encoder", "dit", "vae")}, "gateway": port}
    config = write_config(tmp_path / "deploy.toml", str(stack.model_dir), data_dir, ports)
    with (
        tmpfs(data_dir / "artifacts", size_mib=1) as disk,
        ServiceGroup(load_deploy(config), str(config), log_dir=str(tmp_path), names=("gateway",)),
        GatewayClient(f"127.0.0.1:{port}") as client,
    ):
        with dit_hold.armed():
            jobs = [client.submit(S.GenerateRequest(prompt=f"a fox, take {i}", **HELD)) for i in range(JOBS)]
            next(event for event in client.events(jobs[0].job_id) if dit_hold.holds(event))
            filler = fill(disk)  # while the first is mid-denoise and the others wait for the DiT
        waiting = next(event.waiting for event in client.events(jobs[0].job_id) if event.HasField("waiting"))
        assert waiting.stage == ARTIFACTS_STAGE and waiting.limit_s == 1800.0
        assert re.fullmatch(
            rf"{MARK}: {disk} \(\d+ bytes free of 1\.0 MiB on the file system mounted at {disk}\): "
            r"\d+(\.\d KiB| bytes) needed",
            waiting.reason,
        ), waiting.reason

        filler.unlink()
        ends = [[event for event in client.events(job.job_id) if is_terminal(event)][-1] for job in jobs]
        assert [end.WhichOneof("kind") for end in ends] == ["done"] * JOBS
        for end in ends:
            video = client.download(end.done.video.artifact_id, tmp_path / "videos")
            assert hashlib.sha256(video.read_bytes()).hexdigest() == end.done.video.sha256
        assert [client.job(job.job_id).state for job in jobs] == [S.JOB_STATE_SUCCEEDED] * JOBS
