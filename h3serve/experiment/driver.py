"""The load generator: submits the jobs on the schedule (open loop) or keeps `concurrency` jobs in flight (closed
loop), follows each job's events (the DiT's steps), stops at the bounds, and cancels what outlives the drain.

A Submit the gateway refuses because its queue is full (RESOURCE_EXHAUSTED) is recorded as a rejection and not
retried: in an open loop the offered load is the experiment's input, and a client retrying would change it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from h3serve.client import GatewayClient, describe_event
from h3serve.experiment.arrivals import schedule
from h3serve.experiment.loadspec import LoadSpec
from h3serve.experiment.progress import Progress
from h3serve.experiment.records import StepRow, step_row
from h3serve.experiment.workload import JobKind, Mix

CANCEL_WAIT_S = 60.0  # after the drain: how long cancelled jobs get to reach their terminal event
WARMUP_INDEX = 1_000_000  # warm-up jobs are numbered from here: their prompts and seeds are none of the load's


class ExperimentError(RuntimeError):
    """The experiment cannot go on: a job the gateway refuses for a reason other than load (a bad load file)."""


@dataclass
class Tracked:
    """One submitted job, as the client saw it."""

    index: int
    arrival_s: float  # scheduled offset from the start (closed loop: when it was submitted)
    submitted: float  # unix seconds, before Submit
    job_id: str = ""
    created: float = 0.0  # the gateway's acceptance time (Submit's reply)
    steps: list[StepRow] = field(default_factory=list)
    outcome: str = ""  # the terminal event's kind: done, failed, cancelled
    ended: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class Rejection:
    index: int
    at_s: float  # offset from the start
    reason: str


@dataclass
class Drive:
    started: float  # unix seconds
    ended: float
    jobs: list[Tracked]
    rejected: list[Rejection]


def warm_up(client: GatewayClient, kinds: list[JobKind], count: int, run_id: str) -> None:
    """`count` jobs of each kind, one at a time; each must succeed (else the load file asks for jobs this
    deployment cannot run, and the experiment stops with the reason)."""
    for number, kind in enumerate(kinds):
        for repeat in range(count):
            index = WARMUP_INDEX + number * count + repeat
            final = client.generate(kind.request(index, f"{run_id}-warmup-{index}"))
            if final.WhichOneof("kind") != "done":
                raise ExperimentError(f"warm-up job of mix entry {number}: {describe_event(final)}")


class Driver:
    def __init__(
        self, client: GatewayClient, kinds: list[JobKind], mix: Mix, spec: LoadSpec, progress: Progress, run_id: str
    ) -> None:
        self.client, self.kinds, self.mix, self.spec, self.progress = client, kinds, mix, spec, progress
        self.run_id = run_id
        self.jobs: list[Tracked] = []
        self.rejected: list[Rejection] = []
        self.errors: list[ExperimentError] = []
        self._claimed = 0
        self._lock = threading.Lock()

    def run(self) -> Drive:
        self.t0, started = time.monotonic(), time.time()
        times = schedule(self.spec.arrivals, self.spec.seed)
        threads = self._open_loop(times) if times is not None else self._closed_loop()
        self._drain(threads)
        if self.errors:
            raise self.errors[0]
        return Drive(started, time.time(), sorted(self.jobs, key=lambda j: j.index), self.rejected)

    def _elapsed(self) -> float:
        return time.monotonic() - self.t0

    def _within_bounds(self, index: int, offset_s: float) -> bool:
        bounds = self.spec.bounds
        return (
            (bounds.max_jobs is None or index < bounds.max_jobs)
            and (bounds.max_seconds is None or offset_s <= bounds.max_seconds)
            and not self.errors
        )

    def _open_loop(self, times: Iterator[float]) -> list[threading.Thread]:
        watchers = []
        for index, at in enumerate(times):
            if not self._within_bounds(index, at):
                break
            time.sleep(max(0.0, at - self._elapsed()))
            job = self._submit(index, at)
            if job:
                watchers.append(threading.Thread(target=self._follow, args=(job,), daemon=True))
                watchers[-1].start()
        return watchers

    def _closed_loop(self) -> list[threading.Thread]:
        concurrency = self.spec.arrivals.concurrency
        assert concurrency is not None  # Arrivals refuses a closed loop without one
        clients = [threading.Thread(target=self._client_loop, daemon=True) for _ in range(concurrency)]
        for thread in clients:
            thread.start()
        return clients

    def _client_loop(self) -> None:
        while (index := self._claim()) is not None:
            job = self._submit(index, self._elapsed())
            if job:
                self._follow(job)

    def _claim(self) -> int | None:
        with self._lock:
            if not self._within_bounds(self._claimed, self._elapsed()):
                return None
            self._claimed += 1
            return self._claimed - 1

    def _submit(self, index: int, arrival_s: float) -> Tracked | None:
        job = Tracked(index, arrival_s, time.time())
        request = self.kinds[self.mix.kind(index)].request(index, f"{self.run_id}-{index}")
        try:
            reply = self.client.submit(request)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                with self.progress.lock:
                    self.rejected.append(Rejection(index, self._elapsed(), error.details()))
                    self.progress.counts.rejected += 1
                return None
            self.errors.append(ExperimentError(f"job {index}: Submit refused: {error.code().name}: {error.details()}"))
            return None
        job.job_id, job.created = reply.job_id, reply.created
        with self.progress.lock:
            self.jobs.append(job)
            self.progress.counts.submitted += 1
        return job

    def _follow(self, job: Tracked) -> None:
        """Collect the job's DiT steps (per attempt) until its terminal event."""
        attempt, event = 1, None
        for event in self.client.events(job.job_id):
            kind = event.WhichOneof("kind")
            if kind == "retrying":
                attempt = event.retrying.attempt
            elif kind == "denoising":
                job.steps.append(step_row(event, attempt))
        assert event is not None  # events() ends only after the terminal event
        job.outcome = event.WhichOneof("kind")
        with self.progress.lock:
            counts = self.progress.counts
            if job.outcome == "done":
                counts.done += 1
                counts.latencies.append(event.time - job.created)
            else:
                counts.failed += 1
        job.ended.set()

    def _drain(self, threads: list[threading.Thread]) -> None:
        """Wait for the jobs in flight up to drain_s, then cancel the rest and wait for their ends."""
        deadline = time.monotonic() + self.spec.bounds.drain_s
        for thread in threads:  # closed loop: each client ends with its last job
            thread.join(max(0.0, deadline - time.monotonic()))
        late = [job for job in self.jobs if not job.ended.wait(max(0.0, deadline - time.monotonic()))]
        for job in late:
            self.client.cancel(job.job_id)
        for job in late:
            job.ended.wait(CANCEL_WAIT_S)
