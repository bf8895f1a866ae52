"""Gateways inside the test's own process on a test's job store: a JobRunner, its EventHub and (given the database's
URL) its PostgreSQL Listener, with no servers. Under `quiet_config` their stages are an address nobody answers, so
a job's encoder call stays in progress until something ends it (a takeover, a cancel, an outage). Shared by the
ownership, outage and cross-gateway tests.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from h3serve.common.config import GatewayConfig
from h3serve.common.free_ports import free_port
from h3serve.gateway.assets.store import AssetStore
from h3serve.gateway.assets.validate import AssetLimits
from h3serve.gateway.blobs import DirectoryBlobs
from h3serve.gateway.jobs.artifacts import ArtifactStore
from h3serve.gateway.jobs.events import EventHub
from h3serve.gateway.jobs.postgres.listen import Listener
from h3serve.gateway.jobs.runner import JobRunner
from h3serve.gateway.metrics import GatewayMetrics
from h3serve.gateway.stages import STAGE_NAMES
from h3serve.gateway.stages.calls import StageCaller
from h3serve.v1 import common_pb2, gateway_pb2

QUICK_LEASE_S = 0.6  # renewed every 0.2 s: a lost lease, a missed announcement or a cancel mark is heard within that
QUIET = gateway_pb2.ResolvedRequest(
    prompt="a fox", height=32, width=64, num_frames=9, params=common_pb2.GenerationParams(num_inference_steps=2)
)


def quiet_config(root: Path) -> GatewayConfig:
    """Stages at an address nobody answers; data under `root`."""
    nobody = f"127.0.0.1:{free_port()}"
    return GatewayConfig(data_dir=str(root), encoder=nobody, dit=nobody, vae=nobody, max_attempts=2)


class Gateway:
    """A JobRunner and its EventHub on `store` (each gateway opens its own), and with `url` its Listener; `async
    with` starts the listener and, at the end, shuts the runner down."""

    def __init__(self, store, config: GatewayConfig, name: str, lease_s: float = QUICK_LEASE_S, url: str = ""):
        metrics, blobs = GatewayMetrics(STAGE_NAMES), DirectoryBlobs(config.data_dir)
        self.hub = EventHub(store)
        self.runner = JobRunner(
            config,
            store,
            self.hub,
            StageCaller(config, metrics),
            ArtifactStore(blobs),
            metrics,
            AssetStore(blobs, str(Path(config.data_dir) / "assets"), AssetLimits.from_config(config)),
            gateway_id=name,
            lease_s=lease_s,
        )
        self.listener = Listener(url, name, self.hub.announced, self.runner.cancel, self.hub.reread) if url else None

    async def __aenter__(self) -> Gateway:
        if self.listener:
            self.listener.start()
            await self.listener.listening.wait()
        return self

    async def __aexit__(self, *_) -> None:
        if self.listener:
            await self.listener.stop()
        await self.runner.shutdown()
        await self.runner.caller.close()


async def until(condition) -> None:
    while not await condition():
        await asyncio.sleep(0.05)


async def until_in_encoder(store, job_id: str) -> None:
    """Until the job's first stage call (the encoder's) has started, as `store` reads it."""

    async def in_encoder() -> bool:
        job = await store.get_job(job_id)
        return bool(job.stage_records) and job.stage_records[0].started > 0

    await until(in_encoder)
