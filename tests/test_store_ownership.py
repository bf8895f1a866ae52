"""Jobs' ownership through the job runner, on both store backends: a gateway whose lease on a running job was taken
over stops the job's stage call and writes nothing more of it, and the gateway that took it over counts the
takeover as a restart, never as one of the job's attempts (h3serve/gateway/jobs/runner.py, store.py "Ownership").

Two JobRunners on one store stand for two gateways; the job's encoder is an address nobody answers, so its stage
call stays in progress (retrying through the outage) until something ends it. Gateway A "pauses past its lease"
by its lease being ended in the store (`expire`), as it would run out."""

from __future__ import annotations

import asyncio

import stores
from job_runners import QUICK_LEASE_S, QUIET, Gateway, quiet_config, until_in_encoder

from h3serve.gateway.jobs.runner import INTERRUPTED
from h3serve.v1 import gateway_pb2

S = gateway_pb2
postgres, backend = stores.postgres, stores.backend  # fixtures


def test_a_gateway_that_lost_its_lease_stops_the_job_and_the_taker_counts_a_restart(backend, tmp_path):
    async def scenario(store_a):
        store_b = await backend.open()  # the other gateway's own connection to the store
        try:
            async with (
                Gateway(store_a, quiet_config(tmp_path / "a"), "A") as ga,
                Gateway(store_b, quiet_config(tmp_path / "b"), "B") as gb,
            ):
                a, b = ga.runner, gb.runner
                await store_a.submit("j", QUIET, first_event=S.JobEvent(accepted=S.Accepted()))
                a.start("j", QUIET)
                job_of_a = a._tasks["j"]
                await until_in_encoder(store_a, "j")
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
            await store_b.close()
        job = await store_a.get_job("j")
        assert job.state == S.JOB_STATE_QUEUED, "B's shutdown queued it again, for whoever claims it next"
        assert (await store_a.claim("C", QUICK_LEASE_S)).job_id == "j", "and released its lease"

    backend.run(scenario)
