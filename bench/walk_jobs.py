"""The jobs of a fault walk: submitted as bench.e2e's prompt, watched for the moment to strike, followed to their
end, and counted by how they ended (`Walk`, the walk's result, with the kills that led there)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from bench.common import Size
from bench.results import WALK_COUNTS
from bench.served import PROMPT, SEED
from bench.walk_fp8 import Fp8Aftermath
from bench.walk_stack import Stack, until
from h3serve.client import GatewayClient, describe_event
from h3serve.v1 import common_pb2, gateway_pb2

TERMINAL = (gateway_pb2.JOB_STATE_SUCCEEDED, gateway_pb2.JOB_STATE_FAILED, gateway_pb2.JOB_STATE_CANCELLED)
JOBS_POLL_S = 1.0


@dataclass(frozen=True)
class Kill:
    pid: int
    at: float  # unix seconds
    back_s: float | None  # to the victim SERVING again (None: not within --limit-s)
    pid_after: int | None  # the victim's process once back


@dataclass(frozen=True)
class Walk:
    victim: str
    jobs: dict[str, int]  # WALK_COUNTS
    kills: list[Kill]
    last_job_s: float | None  # from the last kill to the last job's end
    errors: list[str]  # why the jobs that failed did
    fp8: Fp8Aftermath | None = None
    up_exit: int | None = None  # after SIGTERM; None: not within its grace (it was then killed)


def job_request(args, number: int) -> gateway_pb2.GenerateRequest:
    """bench.e2e's prompt at --size and --steps, a seed of its own per job."""
    size = Size.parse(args.size)
    params = common_pb2.GenerationParams(num_inference_steps=args.steps, seed=SEED + number)
    return gateway_pb2.GenerateRequest(
        prompt=PROMPT, height=size.height, width=size.width, num_frames=size.frames, params=params
    )


def poll_jobs(client: GatewayClient, job_ids: list[str]) -> dict[str, gateway_pb2.Job | None] | None:
    """Each job as the gateway has it now (None: it does not know the job, lost); None while it does not answer."""
    found: dict[str, gateway_pb2.Job | None] = {}
    for job_id in job_ids:
        try:
            found[job_id] = client.stub.GetJob(gateway_pb2.GetJobRequest(job_id=job_id), timeout=5)
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.NOT_FOUND:
                return None
            found[job_id] = None
    return found


def state_name(job: gateway_pb2.Job | None) -> str:
    return "lost" if job is None else gateway_pb2.JobState.Name(job.state).removeprefix("JOB_STATE_").lower()


def progress(stack: Stack, client: GatewayClient, job_ids: list[str], service: str) -> str:
    """Which jobs are where, and whether the victim's service serves."""
    polled = poll_jobs(client, job_ids)
    jobs = "the gateway does not answer" if polled is None else dict(Counter(map(state_name, polled.values())))
    return f"jobs {jobs}; {service} {'SERVING' if stack.serving(service) else 'not serving'}"


def wait_for_event(client: GatewayClient, job_id: str, kind: str) -> None:
    """Until the job's first event of `kind`, returned the moment it comes, so that the kill lands right after it."""
    for event in client.events(job_id):
        if event.WhichOneof("kind") == kind:
            return
        last = event
    raise RuntimeError(f"job {job_id} ended ({describe_event(last)}) before any {kind} event: no moment to kill at")


def follow(
    client: GatewayClient, job_ids: list[str], limit_s: float, report: Callable[[], str]
) -> dict[str, gateway_pb2.Job | None]:
    """Each job as the gateway last told it, once every one has ended or is lost, or `limit_s` has passed."""
    latest: dict[str, gateway_pb2.Job | None] = {}

    def ended() -> bool:
        latest.update(poll_jobs(client, job_ids) or {})
        return len(latest) == len(job_ids) and all(job is None or job.state in TERMINAL for job in latest.values())

    until(ended, limit_s, "every job to end", report, poll_s=JOBS_POLL_S)
    return latest


def outcome(victim: str, job_ids: list[str], latest: dict[str, gateway_pb2.Job | None], kills: list[Kill], fp8) -> Walk:
    """The jobs counted by how they ended (cancelled counts as failed: nothing here cancels); a job not seen ended is
    unfinished."""
    lost = [job_id for job_id, job in latest.items() if job is None]
    ended = [job for job in latest.values() if job is not None and job.state in TERMINAL]
    failed = [job for job in ended if job.state != gateway_pb2.JOB_STATE_SUCCEEDED]
    counts = {
        "acknowledged": len(job_ids),
        "succeeded": len(ended) - len(failed),
        "failed": len(failed),
        "lost": len(lost),
        "unfinished": len(job_ids) - len(ended) - len(lost),
        "attempts": sum(job.attempts for job in latest.values() if job is not None),
    }
    last_job_s = max(job.updated for job in ended) - kills[-1].at if ended else None
    errors = [f"{job.job_id}: {job.error.message or state_name(job)}" for job in failed]
    return Walk(victim, {key: counts[key] for key in WALK_COUNTS}, kills, last_job_s, errors, fp8)
