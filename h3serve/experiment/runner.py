"""One experiment against a running deployment: upload the media, drive the load while scraping the gateway's
metrics, read every job's records back (GetJob), write the raw data and render the report."""

from __future__ import annotations

import contextlib
import json
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

import grpc

from h3serve.client import GatewayClient, RetryPolicy
from h3serve.common.config import WILDCARD_HOSTS, GatewayConfig
from h3serve.experiment.driver import Drive, Driver, warm_up
from h3serve.experiment.loadspec import LoadSpec
from h3serve.experiment.media import Uploads
from h3serve.experiment.progress import Progress
from h3serve.experiment.records import METRICS_JSON, RUN_JSON, Records, job_row, stage_rows
from h3serve.experiment.scrape import Scraper, Scrapes
from h3serve.experiment.workload import Mix, prepare

# Only a gateway that is down or restarting is waited for; a full queue is the experiment's result (driver.py).
RETRY = RetryPolicy(codes=frozenset({grpc.StatusCode.UNAVAILABLE}))


def _reachable(host: str) -> str:
    """Where a client on this host reaches a server bound to `host` (a wildcard: loopback)."""
    return "127.0.0.1" if host in WILDCARD_HOSTS else host


@dataclass(frozen=True)
class Target:
    """The deployment's public API and metrics endpoint, from its [gateway] section."""

    address: str
    metrics_url: str  # empty: the deployment serves no metrics (metrics_port = 0)
    tls_root: str = ""  # the gateway's certificate (PEM), when it serves TLS
    token: str = ""

    @classmethod
    def of(cls, gateway: GatewayConfig) -> Target:
        metrics = (
            f"http://{_reachable(gateway.metrics_host)}:{gateway.metrics_port}/metrics" if gateway.metrics_port else ""
        )
        return cls(f"{_reachable(gateway.host)}:{gateway.port}", metrics, gateway.tls_cert, gateway.auth_token)

    def client(self) -> GatewayClient:
        root = Path(self.tls_root).read_bytes() if self.tls_root else None
        return GatewayClient(self.address, root, self.token or None, retry=RETRY)


def stage_replicas(client: GatewayClient) -> dict[str, list[str]]:
    """Each stage's replica addresses, as the gateway routes them (vae-encode runs on the vae replicas)."""
    return {stage.stage: [replica.address for replica in stage.replicas] for stage in client.info().stages}


def _records(client: GatewayClient, drive: Drive) -> Records:
    jobs, stages, steps = [], [], []
    for tracked in drive.jobs:
        job = client.job(tracked.job_id)
        jobs.append(job_row(job, tracked.index, tracked.arrival_s, tracked.submitted))
        stages += stage_rows(job)
        steps += tracked.steps
    return Records(jobs, stages, steps)


def run_experiment(target: Target, spec: LoadSpec, out: Path, stream: TextIO | None, label: str = "") -> Path:
    """Drive the load, write the raw data into `out` (created) and render its report; returns report.html."""
    from h3serve.experiment.report import render  # the plotting stack loads only when there is data to plot

    out.mkdir(parents=True, exist_ok=True)
    with target.client() as client:
        replicas = stage_replicas(client)
        kinds = prepare(spec, Uploads(client), out / "media")
        run_id = uuid.uuid4().hex[:12]
        warm_up(client, kinds, spec.warmup, run_id)
        scraper = Scraper(target.metrics_url, spec.metrics.scrape_s) if target.metrics_url else None
        with scraper or contextlib.nullcontext(), Progress(spec.bounds.max_jobs, stream) as progress:
            drive = Driver(client, kinds, Mix(spec), spec, progress, run_id).run()
        _records(client, drive).write(out)
    run = {
        "label": label or out.name,
        "gateway": target.address,
        "metrics_url": target.metrics_url,
        "replicas": replicas,
        "started": drive.started,
        "ended": drive.ended,
        "load": spec.model_dump(mode="json"),
        "rejected": [asdict(r) for r in drive.rejected],
    }
    (out / RUN_JSON).write_text(json.dumps(run, indent=1))
    (out / METRICS_JSON).write_text(json.dumps((scraper.data if scraper else Scrapes("")).as_json()))
    return render(out)
