"""The fault walk: a deployment with the shipped defaults (`h3serve up`, its supervision, the gateway's outage limits
and attempts), five jobs acknowledged, one process SIGKILLed mid-job. Every job ends SUCCEEDED, whichever process
died; the gateway killed twice spends no attempt of any job, and counts as re-runs after a restart only the stage
calls it caught in progress."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Callable

import grpc
import pytest
from dit_holding import HELD, DitHold
from up_process import CLEAN_EXIT, Up, wait_until

from h3serve.client import GatewayClient
from h3serve.gateway.jobs.runner import INTERRUPTED, MAX_RESTART_RERUNS
from h3serve.v1 import common_pb2, dit_pb2_grpc, gateway_pb2, gateway_pb2_grpc

pytestmark = pytest.mark.processes

DIT = dict(world_size=2)  # two ranks: a rank and the launcher are different processes
JOBS = 5
DONE = gateway_pb2.JOB_STATE_SUCCEEDED
# The two reasons a gateway restart re-runs a job with: a stage call of it was in progress (one of its
# MAX_RESTART_RERUNS), or it only waited in a queue (free).
RERUN = re.compile(
    rf"the gateway restarted while this job was in the (?P<stage>[a-z-]+) stage; re-run (?P<n>\d+) of "
    rf"{MAX_RESTART_RERUNS} after a restart; attempt not counted"
)
WAITED = re.compile(
    r"the gateway restarted while this job waited (for the [a-z-]+ stage|in the queue); attempt not "
    r"counted"
)
TERMINAL = (gateway_pb2.JOB_STATE_SUCCEEDED, gateway_pb2.JOB_STATE_FAILED, gateway_pb2.JOB_STATE_CANCELLED)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, tiny_model_dir, dit_hold):
    up = Up(tmp_path_factory.mktemp("fault-walk"), tiny_model_dir, DIT)
    try:
        up.wait_serving()
        yield up
        up.process.send_signal(signal.SIGTERM)
        assert up.end(clean_logs=False) == CLEAN_EXIT  # the victims' logs say they died
    finally:
        up.close()


def submit(up: Up, name: str, count: int = JOBS) -> list[str]:
    client = GatewayClient(f"127.0.0.1:{up.ports['gateway']}")
    try:
        params = common_pb2.GenerationParams(num_inference_steps=HELD["num_inference_steps"], seed=7)
        return [
            client.stub.Submit(
                gateway_pb2.GenerateRequest(
                    prompt=f"{name} {i}", height=HELD["height"], width=HELD["width"], params=params
                )
            ).job_id
            for i in range(count)
        ]
    finally:
        client.close()


def watch(up: Up, job_id: str, timeout: float):
    """The job's events as they come; nothing more once the deadline passes or the gateway goes away."""
    try:
        with grpc.insecure_channel(f"127.0.0.1:{up.ports['gateway']}") as channel:
            yield from gateway_pb2_grpc.GatewayStub(channel).Watch(
                gateway_pb2.WatchRequest(job_id=job_id), timeout=timeout
            )
    except grpc.RpcError:
        pass  # the deadline of a job still running, or the gateway restarting


def events(up: Up, job_id: str) -> list[gateway_pb2.JobEvent]:
    """All the events of a job that ended."""
    return list(watch(up, job_id, timeout=10.0))


def has(kind: str) -> Callable[[gateway_pb2.JobEvent], bool]:
    return lambda event: event.HasField(kind)


def reached(up: Up, job_id: str, moment: Callable[[gateway_pb2.JobEvent], bool]) -> bool:
    """Whether the job has an event `moment` picks: answered the moment it is seen, so a kill lands right after it."""
    return any(moment(event) for event in watch(up, job_id, timeout=2.0))


def final_jobs(up: Up, job_ids: list[str], limit_s: float = 300) -> list[gateway_pb2.Job]:
    def ended():
        try:
            client = GatewayClient(f"127.0.0.1:{up.ports['gateway']}")
            jobs = [client.stub.GetJob(gateway_pb2.GetJobRequest(job_id=job_id), timeout=5) for job_id in job_ids]
            client.close()
        except grpc.RpcError:
            return None
        return jobs if all(job.state in TERMINAL for job in jobs) else None

    return wait_until(ended, limit_s, "every job ends", poll_s=1.0)


def rank_zero(up: Up) -> int:
    """Rank 0's pid, as the DiT's Info reports it (a rank is a fork of `up`'s fork server, whose environment
    /proc shows)."""
    with grpc.insecure_channel(f"127.0.0.1:{up.ports['dit']}") as channel:
        info = dit_pb2_grpc.DiTStub(channel).Info(common_pb2.InfoRequest(), timeout=10)
    (pid,) = [rank.pid for rank in info.ranks if rank.rank == 0]
    return pid


# The process to kill, and the event of the first job to wait for before killing it: with DitHold.holds, the DiT holds
# the job at that step (mid-denoise) until the kill has landed.
VICTIMS = {
    "encoder": (lambda up: up.service("encoder"), None),
    "dit-rank-0": (rank_zero, DitHold.holds),
    "dit-launcher": (lambda up: up.service("dit"), DitHold.holds),
    "vae": (lambda up: up.service("vae"), has("decoding")),
    "gateway": (lambda up: up.service("gateway"), DitHold.holds),
}


@pytest.mark.parametrize("victim", VICTIMS)
def test_every_acknowledged_job_outlives_a_killed_process(deployment, dit_hold, victim):
    up, (pid_of, moment) = deployment, VICTIMS[victim]
    up.wait_serving()
    with dit_hold.armed() if moment is DitHold.holds else contextlib.nullcontext():
        jobs = submit(up, victim)
        if moment:
            wait_until(lambda: reached(up, jobs[0], moment), 120, f"job 1 at its moment to kill {victim}", poll_s=0.05)
        os.kill(pid_of(up), signal.SIGKILL)
    ended = final_jobs(up, jobs)
    assert [(job.state, job.error.message) for job in ended] == [(DONE, "")] * JOBS
    up.collect()


def test_the_gateway_killed_twice_spends_no_attempt_and_counts_only_the_stage_calls_it_caught(deployment, dit_hold):
    up = deployment
    up.wait_serving()
    with dit_hold.armed():  # job 1 waits mid-denoise at the first kill, and again wherever the second finds it
        jobs = submit(up, "twice")
        wait_until(lambda: reached(up, jobs[0], DitHold.holds), 120, "job 1 held mid-denoise", poll_s=0.05)
        for _ in range(2):
            gateway = up.service("gateway")
            os.kill(gateway, signal.SIGKILL)
            wait_until(
                lambda gateway=gateway: up.service("gateway") not in (None, gateway), 60, "the gateway started again"
            )
            wait_until(lambda: reached(up, jobs[0], has("accepted")), 120, "the gateway answers again")
            time.sleep(1.0)  # the jobs are back in the stage queues when it dies again
    ended = final_jobs(up, jobs)
    assert [job.state for job in ended] == [DONE] * JOBS
    first_reasons = []
    for job in ended:  # a restart spends no attempt; one that caught a stage call in progress is one re-run of 10
        kinds, caught = [], []
        for event in events(up, job.job_id):
            kind = event.WhichOneof("kind")
            kinds.append(kind)
            if kind == "retrying":
                reason = event.retrying.reason
                in_stage, waited = RERUN.fullmatch(reason), WAITED.fullmatch(reason)
                assert (in_stage or waited) and event.retrying.attempt == 1, (job.job_id, event.retrying)
                if in_stage:
                    caught.append((in_stage["stage"], int(in_stage["n"])))
                if job.job_id == jobs[0]:
                    first_reasons.append(reason)
        assert kinds.count("retrying") >= 1 and job.attempts == 1, (job.job_id, job.attempts, " ".join(kinds))
        # the re-runs counted are exactly the passes a kill caught started (their records say so), numbered 1, 2
        assert caught == [
            (record.stage, n)
            for n, record in enumerate((r for r in job.stage_records if r.error == INTERRUPTED and r.started > 0), 1)
        ], (job.job_id, caught)
    assert first_reasons[0] == (
        f"the gateway restarted while this job was in the dit stage; re-run 1 of "
        f"{MAX_RESTART_RERUNS} after a restart; attempt not counted"
    ), first_reasons
