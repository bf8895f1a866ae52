"""Attempts count only what the job did (issue 29): a gateway restart re-runs the jobs it caught in flight without
spending one of their `max_attempts`; a job caught with a stage in progress by more than MAX_RESTART_RERUNS restarts
(a job that may itself bring the gateway down) fails with that reason. The start-up recovery against a real SQLite
file, then a real gateway process SIGKILLed three times with five jobs in flight."""

from __future__ import annotations

import asyncio
import signal

import pytest
from dit_holding import HELD

from h3serve.client import GatewayClient
from h3serve.common.config import GatewayConfig
from h3serve.gateway.jobs.runner import INTERRUPTED, MAX_RESTART_RERUNS
from h3serve.v1 import common_pb2, gateway_pb2

pytestmark = pytest.mark.processes

S = gateway_pb2
REQUEST = S.ResolvedRequest(
    prompt="a fox",
    height=32,
    width=64,
    num_frames=124,
    params=common_pb2.GenerationParams(num_inference_steps=2, seed=1),
)


def test_a_restart_spends_no_attempt_and_the_restart_bound_ends_a_job_caught_in_flight_too_often(tmp_path):
    from h3serve.gateway.jobs.events import EventHub
    from h3serve.gateway.jobs.runner import JobRunner
    from h3serve.gateway.jobs.sqlite import SqliteJobStore
    from h3serve.gateway.metrics import GatewayMetrics
    from h3serve.gateway.stages import STAGE_NAMES
    from h3serve.gateway.stages.calls import StageCaller

    db = str(tmp_path / "jobs.db")

    async def crashed_with_jobs_in_flight(store, times_caught: int = 0):
        """'denoising': its dit call in progress; 'encoded': encoded, waiting for a dit worker; 'poison': in the
        dit stage like 'denoising', already caught by `times_caught` restarts."""
        for job_id in ("denoising", "encoded", "poison"):
            await store.submit(job_id, REQUEST, first_event=S.JobEvent(accepted=S.Accepted()))
            assert await store.start_attempt(job_id) == 1
            encoder = await store.stage_enqueued(job_id, 1, "encoder")
            await store.stage_update(encoder, started=1.0, finished=2.0)
            await store.append_event(job_id, S.JobEvent(encoding=S.Encoding()))
            dit = await store.stage_enqueued(job_id, 1, "dit")
            if job_id != "encoded":
                await store.stage_update(dit, started=3.0)
                await store.append_event(job_id, S.JobEvent(denoising=S.Denoising(step=1)))
        for _ in range(times_caught):
            await store.requeue(
                "poison",
                S.JobEvent(retrying=S.Retrying(attempt=1)),
                count_attempt=False,
                interrupted=INTERRUPTED,
                count_restart=True,
            )
            await store.start_attempt("poison")
            record = await store.stage_enqueued("poison", 1, "dit")
            await store.stage_update(record, started=5.0)

    async def restart(store):
        config = GatewayConfig(max_attempts=1)  # no attempt to spare: only the restart rule can re-run them
        metrics = GatewayMetrics(STAGE_NAMES)
        runner = JobRunner(config, store, EventHub(store), StageCaller(config, metrics), None, metrics, None)
        started = []
        runner.start = lambda job_id, request: started.append(job_id)
        await runner.resume()
        await runner.caller.close()
        return started

    async def scenario():
        store = SqliteJobStore(db)
        await crashed_with_jobs_in_flight(store, times_caught=MAX_RESTART_RERUNS - 1)
        assert await restart(store) == ["denoising", "encoded", "poison"]
        for job_id in ("denoising", "encoded", "poison"):
            job = await store.get_job(job_id)
            assert (job.state, job.attempts) == (S.JOB_STATE_QUEUED, 0), job_id
            assert [r.error for r in job.stage_records if r.finished == 0] == [INTERRUPTED] * len(
                [r for r in job.stage_records if r.finished == 0]
            ), job_id
        retrying = {job_id: (await store.events(job_id))[-1].retrying for job_id in ("denoising", "encoded", "poison")}
        assert retrying["denoising"] == S.Retrying(
            attempt=1,
            max_attempts=1,
            reason=(
                f"the gateway restarted while this job was in the dit stage; re-run 1 of {MAX_RESTART_RERUNS} after a "
                "restart; attempt not counted"
            ),
        )
        assert (
            retrying["encoded"].reason == "the gateway restarted while this job waited for the dit stage; "
            "attempt not counted"
        )
        assert retrying["poison"].reason.startswith(
            "the gateway restarted while this job was in the dit stage; "
            f"re-run {MAX_RESTART_RERUNS} of {MAX_RESTART_RERUNS}"
        )

        # Each runs again and is caught once more: the poison job is past its bound, the others are not.
        for job_id in ("denoising", "encoded", "poison"):
            assert await store.start_attempt(job_id) == 1
            record = await store.stage_enqueued(job_id, 1, "dit")
            if job_id != "encoded":
                await store.stage_update(record, started=9.0)
        assert await restart(store) == ["denoising", "encoded"]
        poison = await store.get_job("poison")
        assert poison.state == S.JOB_STATE_FAILED and poison.error.code_name == "ABORTED"
        assert poison.error.message == (
            f"the gateway restarted while this job was in the dit stage: {MAX_RESTART_RERUNS + 1} restarts caught one "
            "of its stages in progress; restarts spend none of its 1 attempts, but after "
            f"{MAX_RESTART_RERUNS} such re-runs the job ends, in case it is what brings the gateway down"
        )
        assert (await store.get_job("denoising")).attempts == 0
        assert "re-run 2 of" in (await store.events("denoising"))[-1].retrying.reason
        await store.close()

    asyncio.run(scenario())


@pytest.mark.gateway
def test_five_jobs_survive_three_gateway_kills_without_spending_an_attempt(stack, dit_hold):
    """The field report: three gateway kills within a minute failed five queued jobs with `ABORTED ... (attempt 3
    of 3)`. Here the first job is mid-denoise at every kill, held there by the DiT (the others encoded or queued
    behind it): all complete, each on its first attempt."""
    requests = [S.GenerateRequest(prompt=f"restart-proof clip {i}", **HELD, seed=i) for i in range(5)]
    with dit_hold.armed():
        with GatewayClient(stack.address("gateway")) as client:
            jobs = [client.stub.Submit(request) for request in requests]
        first = jobs[0].job_id
        for kill in range(3):
            with GatewayClient(stack.address("gateway")) as client:
                restarts = 0
                for event in client.stub.Watch(S.WatchRequest(job_id=first)):
                    restarts += event.HasField("retrying")
                    if restarts == kill and dit_hold.holds(event):
                        break  # the first job is held mid-denoise after `kill` restarts
                else:
                    pytest.fail(f"job {first} ended before kill {kill + 1}")
            stack.group.restart("gateway", signal.SIGKILL)
    with GatewayClient(stack.address("gateway")) as client:
        ended = []
        for job in jobs:
            events = list(client.stub.Watch(S.WatchRequest(job_id=job.job_id)))
            ended.append((client.job(job.job_id), events))
    for job, events in ended:
        kinds = [event.WhichOneof("kind") for event in events]
        assert (job.state, job.error.message, kinds[-1]) == (S.JOB_STATE_SUCCEEDED, "", "done"), kinds
        assert job.attempts == 1, kinds
        assert all(e.retrying.reason.endswith("attempt not counted") for e in events if e.HasField("retrying"))
    # each kill caught the first job in its dit stage call, where the DiT held it: its records say so, and each such
    # pass is one re-run, numbered
    job, events = ended[0]
    caught = [r.stage for r in job.stage_records if r.error == INTERRUPTED and r.started > 0]
    first_retries = [e.retrying.reason for e in events if e.HasField("retrying")]
    assert caught == ["dit"] * 3, caught
    assert first_retries == [
        f"the gateway restarted while this job was in the {stage} stage; re-run {n} of "
        f"{MAX_RESTART_RERUNS} after a restart; attempt not counted"
        for n, stage in enumerate(caught, 1)
    ]
