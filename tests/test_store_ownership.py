"""Jobs' ownership through the job runner, on both store backends: a gateway whose lease on a running job was taken
over stops the job's stage call and writes nothing more of it, and the gateway that took it over counts the
takeover as a restart, never as one of the job's attempts (h3serve/gateway/jobs/runner.py, store.py "Ownership").

Two JobRunners on one store stand for two gateways; the job's encoder is an address nobody answers, so its stage
call stays in progress (retrying through the outage) until something ends it. Gateway A "pauses past its lease"
by its lease being ended in the store (`expire`), as it would run out."""

from __future__ import annotations

import asyncio

import stores

from h3serve.common.config import GatewayConfig
from h3serve.common.free_ports import free_port
from h3serve.gateway.assets.store import AssetStore
from h3serve.gateway.assets.validate import AssetLimits
from h3serve.gateway.blobs import DirectoryBlobs
from h3serve.gateway.jobs.artifacts import ArtifactStore
from h3serve.gateway.jobs.events import EventHub
from h3serve.gateway.jobs.runner import INTERRUPTED, JobRunner
from h3serve.gateway.metrics import GatewayMetrics
from h3serve.gateway.stages import STAGE_NAMES
from h3serve.gateway.stages.calls import StageCaller
from h3serve.v1 import common_pb2, gateway_pb2

S = gateway_pb2
REQUEST = S.ResolvedRequest(
    prompt="a fox", height=32, width=64, num_frames=9, params=common_pb2.GenerationParams(num_inference_steps=2)
)
LEASE_S = 0.6  # renewed every 0.2 s: A hears of the takeover at its next renewal
postgres, backend = stores.postgres, stores.backend  # fixtures


def _runner(store, tmp_path, name: str, port: int) -> JobRunner:
    nobody = f"127.0.0.1:{port}"
    config = GatewayConfig(data_dir=str(tmp_path), encoder=nobody, dit=nobody, vae=nobody, max_attempts=2)
    metrics = GatewayMetrics(STAGE_NAMES)
    caller = StageCaller(config, metrics)
    blobs = DirectoryBlobs(str(tmp_path))
    assets = AssetStore(blobs, str(tmp_path / "assets"), AssetLimits.from_config(config))
    artifacts = ArtifactStore(blobs)
    hub = EventHub(store)
    return JobRunner(config, store, hub, caller, artifacts, metrics, assets, gateway_id=name, lease_s=LEASE_S)


async def _until(condition) -> None:
    while not await condition():
        await asyncio.sleep(0.05)


def test_a_gateway_that_lost_its_lease_stops_the_job_and_the_taker_counts_a_restart(backend, tmp_path):
    port = free_port()  # nothing listens on it

    async def scenario(store_a):
        store_b = await backend.open()  # the other gateway's own connection to the store
        a, b = _runner(store_a, tmp_path / "a", "A", port), _runner(store_b, tmp_path / "b", "B", port)
        try:
            await store_a.submit("j", REQUEST, first_event=S.JobEvent(accepted=S.Accepted()))
            a.start("j", REQUEST)
            job_of_a = a._tasks["j"]

            async def in_encoder():
                job = await store_a.get_job("j")
                return bool(job.stage_records) and job.stage_records[0].started > 0

            await _until(in_encoder)
            assert await store_b.expire("A") == 1  # A's lease runs out (A paused, or cut off)
            await b._claim_all()
            assert "j" in b._tasks, "B took the job over and runs it"
            await asyncio.wait_for(job_of_a, 60)  # a safety bound only: A stops at its next renewal
            assert a.queues["encoder"].busy == 0, "A's stage call was cancelled"
            job = await store_b.get_job("j")
            assert (job.state, job.attempts) == (S.JOB_STATE_RUNNING, 1), "the takeover spent no attempt"
            assert [u.restarts for u in await store_b.unfinished()] == [1]
            assert job.stage_records[0].error == INTERRUPTED, "A wrote nothing after the takeover"
            retrying = [e.retrying for e in await store_b.events("j") if e.HasField("retrying")]
            assert [(r.attempt, r.reason.endswith("attempt not counted")) for r in retrying] == [(1, True)]
        finally:
            await b.shutdown()
            await a.shutdown()
            await a.caller.close()
            await b.caller.close()
            await store_b.close()
        job = await store_a.get_job("j")
        assert job.state == S.JOB_STATE_QUEUED, "B's shutdown queued it again, for whoever claims it next"
        assert (await store_a.claim("C", LEASE_S)).job_id == "j", "and released its lease"

    backend.run(scenario)
