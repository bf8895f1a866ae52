"""A real `h3serve serve gateway` on PostgreSQL ([gateway] store_url): its jobs are in the database, not in its
data_dir, and outlive the gateway; a database it cannot reach is refused at start (EXIT_REFUSED) naming store_url."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import stores
from deployments import write_config

from h3serve.cli.launcher import ServiceGroup
from h3serve.client import GatewayClient
from h3serve.common.config import load_deploy
from h3serve.common.free_ports import free_port
from h3serve.common.processes import EXIT_REFUSED
from h3serve.common.server import is_answering
from h3serve.v1 import gateway_pb2

pytestmark = pytest.mark.processes

S = gateway_pb2
postgres = stores.postgres  # fixture


def _deployment(tmp_path: Path, store_url: str) -> tuple[Path, int]:
    """A gateway alone (its stages never answer), on the database at `store_url`."""
    port = free_port()
    ports = dict(encoder=1, dit=2, vae=3, gateway=port)
    return write_config(tmp_path / "deploy.toml", "", tmp_path / "gateway", ports, store_url=store_url), port


def test_a_gateway_keeps_its_jobs_in_postgresql_across_a_restart(postgres, tmp_path):
    url = postgres.new_database()
    config, port = _deployment(tmp_path, url)

    with (
        ServiceGroup(load_deploy(config), str(config), log_dir=str(tmp_path), names=("gateway",), ready=is_answering),
        GatewayClient(f"127.0.0.1:{port}") as client,
    ):
        job = client.stub.Submit(S.GenerateRequest(prompt="a fox", request_id="once"))
        again = client.stub.Submit(S.GenerateRequest(prompt="a fox", request_id="once"))
        assert again.job_id == job.job_id
    assert not (tmp_path / "gateway" / "jobs.sqlite").exists(), "no SQLite store beside a PostgreSQL one"

    found = stores.Backend("postgresql", url).run(lambda store: store.get_job(job.job_id))
    assert found is not None and found.request.prompt == "a fox" and found.request_id == "once"
    with (
        ServiceGroup(load_deploy(config), str(config), log_dir=str(tmp_path), names=("gateway",), ready=is_answering),
        GatewayClient(f"127.0.0.1:{port}") as client,
    ):
        assert [j.job_id for j in client.stub.ListJobs(S.ListJobsRequest()).jobs] == [job.job_id]


def test_a_database_the_gateway_cannot_reach_is_refused_naming_store_url(postgres, tmp_path):
    url = postgres.url("no_such_database")
    config, _ = _deployment(tmp_path, url)
    refused = subprocess.run(
        [sys.executable, "-m", "h3serve.cli", "serve", "gateway", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == EXIT_REFUSED, refused.stderr
    last = refused.stderr.splitlines()[-1]
    assert last == (
        "refused: [gateway] store_url: the job store's PostgreSQL cannot be used (connection failed: connection to "
        f'server on socket "{postgres.socket_dir}/.s.PGSQL.{postgres.port}" failed: FATAL:  database '
        '"no_such_database" does not exist); start it, or fix store_url'
    )
    assert "Traceback" not in refused.stderr
