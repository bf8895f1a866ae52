"""Runs jobs: each job's workflow plan, stage by stage, turning stage progress into JobEvents.

A plan is a list of steps of stage names (h3serve/model/workflows), the stages are declarations
(h3serve/gateway/stages); this module only executes them. Each stage has its own queue and workers
(`StageQueue`), so jobs overlap across stages. Every pass through a stage is recorded (queued,
started, finished, replica, bytes). A stalled stage makes the job run again from the start (same
seed, same result) while attempts remain; that policy, and the reasons jobs give, live here.

A gateway runs a job only while it holds the job's lease (store.py, "Ownership"): it claims the job (at submit, at
its start, and every LEASE_S / RENEWALS_PER_LEASE in its claim loop, which takes over jobs whose holder's lease ran
out), renews the lease with every write about the job and with a timer in quiet phases, and fences every write with
it. A gateway that lost a job's lease (Fenced) cancels the job's stage calls and writes nothing more of it; a
takeover counts as a restart, never as one of the job's attempts.

Every job ends in exactly one terminal state, written to the store together with its terminal event.
That is guaranteed by `_run`'s handlers, not by any single signal: a job that escaped the expected
errors is still marked FAILED (the field notes' ghost "running" job). A finished clip whose artifact the disk
cannot hold waits for space up to [gateway] artifact_space_wait_s. Any other full disk (DiskFull) fails the job
with RESOURCE_EXHAUSTED naming it; when the disk is too full to record even that end, the job keeps its task
and records it once space returns (`_finish`), so it never stays "running" without one.

A job store out of reach (StoreUnavailable: PostgreSQL down, restarting, cut off) pauses a running job: each of its
writes waits and tries again (`_patiently`, backing off to STORE_RETRY_MAX_S), under the job's lease as it is at each
try. A store back within the job's lease: the fence decides, and the job goes on where it was (or stops, writing
nothing, if another gateway took it over meanwhile). A wait past the lease: another gateway may hold the job by now
(this one, cut off, cannot know), so its stage calls stop here and nothing more of it is written (`LeaseLapsed`, as
Fenced); once the store is back a claim takes the job again, this gateway's own if no other did.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from h3serve.common.config import GatewayConfig
from h3serve.common.disk import DiskFull, space_wanted
from h3serve.common.errors import describe, tail
from h3serve.gateway.assets.store import AssetStore
from h3serve.gateway.jobs.artifacts import ArtifactStore, BytesLike
from h3serve.gateway.jobs.drain import DrainEstimate
from h3serve.gateway.jobs.events import EventHub
from h3serve.gateway.jobs.retention import Retention
from h3serve.gateway.jobs.store import Fenced, JobStore, Lease, StoreUnavailable, Unfinished
from h3serve.gateway.metrics import GatewayMetrics
from h3serve.gateway.stages.calls import CallRecord, StageCaller, StageFailed
from h3serve.gateway.stages.card import Card
from h3serve.gateway.stages.queue import StageQueue
from h3serve.gateway.stages.stage import JobContext, Stage, StageOutput
from h3serve.gateway.stages.watchdog import Stuck, Watchdog
from h3serve.model import workflows
from h3serve.v1 import gateway_pb2

log = logging.getLogger("h3serve.gateway.jobs")
S = gateway_pb2
CANCELLED_BY_CLIENT = "cancelled by CancelJob"
INTERRUPTED = "the gateway stopped during this pass"  # the error a dead gateway's open stage records get
# A gateway restart is not the job's fault: a job in flight when the gateway died runs again without spending one of
# its `max_attempts` (those count only what the job did: runs lost to a stall). The guard against a job that itself
# brings the gateway down every time (a poison job) is a separate bound: a restart that caught one of the job's stage
# calls in progress counts as one of its MAX_RESTART_RERUNS; the job's next such restart fails it (ABORTED, with this
# reason). A job that was only waiting in a queue (before its first stage or between two) had nothing running, so it
# cannot be the cause: its re-run is free and counted nowhere. A bound, not a judgement of which job was running for
# how long: simple, and wrong only for a job caught in flight by more restarts than this, which then says why.
MAX_RESTART_RERUNS = 10
DISK_RETRY_S = 2.0  # how often a job whose end or artifact a full disk keeps from the store tries to write it again
ARTIFACTS_STAGE = "artifacts"  # the `waiting` event's stage while a finished clip waits for space on the disk
# How long a claim holds a job without a renewal: how long a job whose gateway died waits for another to take it over
# (a gateway's own restart takes its jobs back at once: `resume`). Renewed RENEWALS_PER_LEASE times per lease by the
# timer, so a renewal can fail twice before the lease runs out; the claim loop looks for jobs as often.
LEASE_S = 30.0
RENEWALS_PER_LEASE = 3
# How a running job's write waits out a job store out of reach: tried again after STORE_RETRY_FIRST_S, the wait
# doubling up to STORE_RETRY_MAX_S, so a store back is used within that.
STORE_RETRY_FIRST_S = 0.25
STORE_RETRY_MAX_S = 4.0
T = TypeVar("T")


class LeaseLapsed(Fenced):
    """A write waited for the job store longer than the job's lease: another gateway may hold the job now."""

    def __init__(self, job_id: str, lease: Lease, cause: StoreUnavailable):
        Exception.__init__(
            self, f"job {job_id}: the job store was out of reach past its lease ({lease.seconds:g} s): {cause}"
        )


def failure(code: grpc.StatusCode, message: str) -> gateway_pb2.Failed:
    return S.Failed(code=code.value[0], code_name=code.name, message=tail(message))


async def all_of(*calls: Awaitable) -> list:
    """Every result; when one fails the others are cancelled, so no stage call outlives its job's attempt."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class JobRunner:
    def __init__(
        self,
        config: GatewayConfig,
        store: JobStore,
        hub: EventHub,
        caller: StageCaller,
        artifacts: ArtifactStore,
        metrics: GatewayMetrics,
        assets: AssetStore,
        gateway_id: str = "gateway",
        lease_s: float = LEASE_S,
    ) -> None:
        self.store, self.hub, self.caller, self.artifacts, self.metrics = store, hub, caller, artifacts, metrics
        self.gateway_id, self.lease_s = gateway_id, lease_s
        self.assets = assets
        self.max_attempts, self.stall_s = config.max_attempts, config.stall_s
        self.space_wait_s = config.artifact_space_wait_s
        self.queues = {
            name: StageQueue(name, len(caller.replicas[stage.service].replicas))
            for name, stage in caller.stages.items()
        }
        self.card = Card(caller.supervisor_state) if config.stages_take_turns else None  # stage calls one at a time
        self.retention = Retention(
            store, artifacts, config.artifact_max_age_s, config.artifact_max_bytes, assets, config.asset_max_age_s
        )
        self._tasks: dict[str, asyncio.Task] = {}
        self._leases: dict[str, Lease] = {}  # the jobs this gateway holds
        self._fenced: set[str] = set()  # jobs whose lease another gateway took: their tasks stop, writing nothing
        self._renewals: dict[str, asyncio.Task] = {}  # each held job's lease timer
        self._cancel_requested: set[str] = set()
        self._ends_waiting: dict[str, DiskFull] = {}  # jobs whose end a full disk keeps from the store, and why
        self.drain = DrainEstimate()  # how long jobs stay: the retry time a full queue advises
        self._stopping = False  # shutting down: a store out of reach is not waited for (the leases run out instead)

    def start(self, job_id: str, request: gateway_pb2.ResolvedRequest) -> None:
        """Run the job here: under the lease this gateway's claim loop took, or (a job just submitted) once claimed."""
        if job_id in self._tasks:
            return
        task = asyncio.get_running_loop().create_task(self._run(job_id, request), name=f"job-{job_id}")
        self._tasks[job_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(job_id, None) if self._tasks.get(job_id) is task else None)

    async def request_cancel(self, job_id: str) -> bool:
        """Cancel the job wherever it runs (False: it had already ended). A job running here stops at once (before
        the store is written: a full disk must not keep it running); the request is also marked in the store, where
        the job's holder hears of it (at once on PostgreSQL, else at its next renewal); a job no gateway holds ends
        here, in the store."""
        here = self.cancel(job_id)
        holder = await self.store.request_cancel(job_id)
        if here or holder:
            return True
        if holder is None:
            return False
        self.hub.publish(await self.store.finish(job_id, S.JOB_STATE_CANCELLED, S.JobEvent(cancelled=_by_client())))
        return True

    def cancel(self, job_id: str) -> bool:
        """Stop a job running here (False: none runs here); its stage call is cancelled, the DiT stops at a step
        boundary. Its terminal `cancelled` event is written by its own task, once."""
        task = self._tasks.get(job_id)
        if task is None:
            return False
        # Already ending: cancelling its task again would cut the write of its end (a second request, or a full
        # disk's retries), leaving it running in the store with no worker.
        if job_id in self._ends_waiting or job_id in self._cancel_requested:
            return True
        self._cancel_requested.add(job_id)
        task.cancel()
        return True

    def end_waiting(self, job_id: str) -> DiskFull | None:
        """Why the job's end is not recorded yet, while a full disk keeps it from the store (else None)."""
        return self._ends_waiting.get(job_id)

    async def shutdown(self) -> None:
        """Stop in-flight jobs without a verdict: they go back to the queue, their attempt not counted, and the
        next start runs them again."""
        self._stopping = True
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def resume(self) -> None:
        """At start-up: this gateway's jobs from before (its earlier run's leases) and every other job whose lease
        ran out are claimed and run; jobs in flight run again without spending an attempt, or fail with the reason
        when restarts caught them in a stage more than MAX_RESTART_RERUNS times."""
        await self.store.expire(self.gateway_id)
        await self._claim_all()

    async def claim_loop(self) -> None:
        """Every lease_s / RENEWALS_PER_LEASE: take over the jobs whose holder's lease ran out (a gateway gone)."""
        while True:
            await asyncio.sleep(self.lease_s / RENEWALS_PER_LEASE)
            try:
                await self._claim_all()
            except Exception as exc:  # the store unreachable a while: the next round tries again
                log.warning("claiming jobs: %s", describe(exc, lines=1))

    async def _claim_all(self) -> None:
        reran = started = 0
        while (job := await self.store.claim(self.gateway_id, self.lease_s)) is not None:
            self._leases[job.job_id] = Lease(self.gateway_id, job.fence, self.lease_s)
            if job.job_id in self._tasks:  # its own task here, whose lease had run out: it goes on under the new one
                continue
            reran += job.state == S.JOB_STATE_RUNNING
            try:
                if await self._take_over(job):
                    self.start(job.job_id, job.request)
                    started += 1
            except Fenced as exc:  # taken from this gateway in the meantime
                self._leases.pop(job.job_id, None)
                log.warning("job %s: %s", job.job_id, exc)
        self.metrics.job_retries.labels("restart").inc(reran)
        if started:
            log.info("claimed %d job(s) (%d interrupted in flight)", started, reran)

    async def _take_over(self, job: Unfinished) -> bool:
        """A claimed job that was running (its gateway stopped, or lost its lease) is queued again without spending
        an attempt, or ends past the restart bound (then False: nothing to run). A job whose cancel was requested
        while its holder was gone ends cancelled."""
        if await self.store.cancel_requested(job.job_id):
            await self._finish(job.job_id, S.JOB_STATE_CANCELLED, cancelled=_by_client())
            self._leases.pop(job.job_id, None)
            return False
        if job.state != S.JOB_STATE_RUNNING:
            return True
        if not job.in_stage:
            waited = f"for the {job.last_stage} stage" if job.last_stage else "in the queue"
            await self._requeue_uncounted(
                job.job_id, self._interrupted(job, f"waited {waited}"), interrupted=INTERRUPTED
            )
            return True
        if job.restarts < MAX_RESTART_RERUNS:
            await self._requeue_uncounted(
                job.job_id,
                self._interrupted(job, "was in {where}") + f"; re-run {job.restarts + 1}"
                f" of {MAX_RESTART_RERUNS} after a restart",
                interrupted=INTERRUPTED,
                count_restart=True,
            )
            return True
        log.warning("job %s failed: caught in flight by %d gateway restarts", job.job_id, job.restarts + 1)
        await self._finish(
            job.job_id,
            S.JOB_STATE_FAILED,
            failed=failure(
                grpc.StatusCode.ABORTED,
                self._interrupted(job, f"was in {_where(job.last_stage)}") + f": {job.restarts + 1} "
                f"restarts caught one of its stages in progress; restarts spend none of its "
                f"{self.max_attempts} attempts, but after {MAX_RESTART_RERUNS} such re-runs the job "
                "ends, in case it is what brings the gateway down",
            ),
        )
        self._leases.pop(job.job_id, None)
        return False

    def _interrupted(self, job: Unfinished, doing: str) -> str:
        """What ended the run of a claimed job while it was `doing` something: this gateway's own restart (its
        earlier run held the job), or another gateway's lease that ran out (it stopped, or was cut off)."""
        if job.holder in ("", self.gateway_id):
            return f"the gateway restarted while this job {doing}"
        return f"gateway {job.holder}'s lease ran out while this job {doing}; gateway {self.gateway_id} took it over"

    async def _run(self, job_id: str, request: gateway_pb2.ResolvedRequest) -> None:
        """The job's worker while this gateway holds its lease; a lost lease (Fenced) ends it writing nothing."""
        try:
            await self._work(job_id, request)
        except Fenced as exc:
            log.warning("job %s: %s; its stage calls stop here and nothing more of it is written", job_id, exc)
        finally:
            if (renewal := self._renewals.pop(job_id, None)) is not None:
                renewal.cancel()
            self._leases.pop(job_id, None)
            self._fenced.discard(job_id)

    async def _hold(self, job_id: str) -> bool:
        """Claim the job unless this gateway holds it already (False: another gateway runs it), and keep its lease
        renewed while it runs here."""
        if job_id not in self._leases:
            claimed = await self._patiently(job_id, lambda: self.store.claim(self.gateway_id, self.lease_s, job_id))
            if claimed is None:
                return False
            self._leases[job_id] = Lease(self.gateway_id, claimed.fence, self.lease_s)
        self._renewals[job_id] = asyncio.get_running_loop().create_task(self._renew(job_id), name=f"lease-{job_id}")
        return True

    async def _renew(self, job_id: str) -> None:
        """Renew the job's lease in quiet phases (a long DiT call writes nothing for minutes); a lease another
        gateway took cancels the job's task, which then writes nothing. A cancel requested on any gateway
        (request_cancel) stops the job here at the latest at its next renewal."""
        renewed = time.monotonic()
        while True:
            await asyncio.sleep(self.lease_s / RENEWALS_PER_LEASE)
            try:
                await self.store.renew(job_id, self._leases[job_id])
                renewed = time.monotonic()
                if await self.store.cancel_requested(job_id):  # its announcement missed (or not on PostgreSQL)
                    self.cancel(job_id)  # (once: the lease is still renewed while the task records its end)
            except Fenced as exc:
                self._stop_fenced(job_id, exc)
                return
            except StoreUnavailable as exc:  # the job's own writes wait for it (`_patiently`); a quiet phase has none
                lease = self._leases[job_id]
                if time.monotonic() - renewed > lease.seconds:  # another gateway may hold the job by now
                    self._stop_fenced(job_id, LeaseLapsed(job_id, lease, exc))
                    return
                log.warning("job %s: renewing its lease: %s", job_id, describe(exc, lines=1))
            except Exception as exc:
                log.warning("job %s: renewing its lease: %s", job_id, describe(exc, lines=1))

    def _stop_fenced(self, job_id: str, exc: Fenced) -> None:
        """The job is no longer this gateway's: its task is cancelled and writes nothing more."""
        log.warning("job %s: %s", job_id, exc)
        self._fenced.add(job_id)
        self._tasks[job_id].cancel()

    def _lease(self, job_id: str) -> Lease | None:
        """The job's lease now (read at each write: the claim loop may have renewed a lapsed one)."""
        return self._leases.get(job_id)

    async def _patiently(self, job_id: str, write: Callable[[], Awaitable[T]]) -> T:
        """`write()` (which reads the job's lease itself: each try is under the lease as it is then), tried again
        while the store is out of reach (but for a gateway shutting down), up to the job's lease (then LeaseLapsed);
        Fenced, or any other error, ends the wait."""
        delay, since = STORE_RETRY_FIRST_S, time.monotonic()
        while True:
            try:
                result = await write()
            except StoreUnavailable as exc:
                if self._stopping:
                    raise
                lease = self._lease(job_id)  # renewed last before this wait began: by now it has run out
                if lease is not None and time.monotonic() - since > lease.seconds:
                    raise LeaseLapsed(job_id, lease, exc) from exc
                if delay == STORE_RETRY_FIRST_S:
                    log.warning(
                        "job %s waits for the job store, trying again up to every %g s: %s",
                        job_id,
                        STORE_RETRY_MAX_S,
                        exc,
                    )
                await asyncio.sleep(delay)
                delay = min(2 * delay, STORE_RETRY_MAX_S)
                continue
            if delay > STORE_RETRY_FIRST_S:
                log.info(
                    "job %s: the job store answers again after %.0f s; the job goes on",
                    job_id,
                    time.monotonic() - since,
                )
            return result

    async def _emit(self, job_id: str, **kind) -> gateway_pb2.JobEvent:
        return await self._patiently(job_id, lambda: self.hub.emit(job_id, lease=self._lease(job_id), **kind))

    async def _work(self, job_id: str, request: gateway_pb2.ResolvedRequest) -> None:
        began = time.monotonic()
        try:
            if not await self._hold(job_id):  # inside the handlers: a claim a full disk refuses fails the job
                return
            while attempt := await self._patiently(
                job_id, lambda: self.store.start_attempt(job_id, lease=self._lease(job_id))
            ):
                if await self._attempt(job_id, request, attempt):
                    return
        except asyncio.CancelledError:
            if job_id in self._fenced:  # another gateway holds it now: not this gateway's to write
                return
            if job_id not in self._cancel_requested:  # gateway shutdown: run again at the next start, or elsewhere
                if (lease := self._lease(job_id)) is not None:  # (not claimed yet: nothing of it is this gateway's)
                    try:
                        await self._requeue_uncounted(job_id, "the gateway shut down while this job was in {where}")
                        await self.store.release(job_id, lease)
                    except StoreUnavailable as exc:  # its lease runs out instead, and a claim takes it then
                        log.warning("job %s is left to its lease: %s", job_id, exc)
                raise
            await self._finish(job_id, S.JOB_STATE_CANCELLED, cancelled=_by_client())
        except Fenced:  # not this gateway's job to end any more (a takeover, or its lease lapsed): `_run` says so
            raise
        except StoreUnavailable as exc:  # met by a call not waited for: nothing of it is written; an unfinished job
            log.warning("job %s: its worker here stops: %s", job_id, exc)  # is claimed again once its lease runs out
        except StageFailed as exc:
            await self._finish(job_id, S.JOB_STATE_FAILED, failed=failure(exc.code, str(exc)))
        except DiskFull as exc:
            if job_id in self._cancel_requested:  # met while the cancel was being recorded: the client's word stands
                await self._finish(job_id, S.JOB_STATE_CANCELLED, cancelled=_by_client())
                return
            log.warning("job %s failed: %s", job_id, exc)
            await self._finish(job_id, S.JOB_STATE_FAILED, failed=failure(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)))
        except Exception as exc:
            log.exception("job %s failed", job_id)
            await self._finish(
                job_id,
                S.JOB_STATE_FAILED,  # the error itself; its traceback is in the log
                failed=failure(grpc.StatusCode.INTERNAL, describe(exc, lines=1)),
            )
        finally:
            self._cancel_requested.discard(job_id)
            self.drain.ended(time.monotonic() - began)

    async def _attempt(self, job_id: str, request: gateway_pb2.ResolvedRequest, attempt: int) -> bool:
        """One run from the start; False when it stalled and the job was queued for another attempt."""
        try:
            await self._pipeline(job_id, request, attempt)
            return True
        except Stuck as exc:
            self.metrics.stalls.labels(exc.phase).inc()
            log.warning("job %s attempt %d: %s", job_id, attempt, exc)
            if await self._retry_or_fail(job_id, attempt, str(exc), grpc.StatusCode.DEADLINE_EXCEEDED):
                self.metrics.job_retries.labels("stall").inc()
                return False
            return True

    async def _retry_or_fail(self, job_id: str, attempts: int, reason: str, code: grpc.StatusCode) -> bool:
        """An attempt was lost: queue the job again while attempts remain (True), else fail it with `reason`."""
        if attempts < self.max_attempts:
            retrying = S.Retrying(attempt=attempts + 1, max_attempts=self.max_attempts, reason=reason)
            requeued = await self._patiently(
                job_id, lambda: self.store.requeue(job_id, S.JobEvent(retrying=retrying), lease=self._lease(job_id))
            )
            self.hub.publish(requeued)
            return True
        await self._finish(
            job_id, S.JOB_STATE_FAILED, failed=failure(code, f"{reason} (attempt {attempts} of {self.max_attempts})")
        )
        return False

    async def _requeue_uncounted(self, job_id: str, why: str, **restart) -> None:
        """Queue the job again without counting the interrupted attempt; the `retrying` event repeats its number and
        says `why` ("{where}": the stage the job was in). `restart`: JobStore.requeue's `interrupted` and
        `count_restart`, at a start-up."""
        job = await self._patiently(job_id, lambda: self.store.get_job(job_id))
        assert job is not None  # a job being requeued is in the store
        where = _where(job.stage_records[-1].stage if job.stage_records else "")
        retrying = S.Retrying(
            attempt=job.attempts,
            max_attempts=self.max_attempts,
            reason=why.format(where=where) + "; attempt not counted",
        )
        requeued = await self._patiently(
            job_id,
            lambda: self.store.requeue(
                job_id, S.JobEvent(retrying=retrying), count_attempt=False, lease=self._lease(job_id), **restart
            ),
        )
        self.hub.publish(requeued)

    async def _finish(self, job_id: str, state: int, **terminal) -> None:
        """Record the job's end with its terminal event. While a full disk keeps it from the store, try again every
        DISK_RETRY_S: this task stays the job's worker until the end is written."""
        event = S.JobEvent(**terminal)
        for tries in itertools.count():
            try:
                ended = await self._patiently(
                    job_id, lambda: self.store.finish(job_id, state, event, lease=self._lease(job_id))
                )
                self.hub.publish(ended)
                self._ends_waiting.pop(job_id, None)
                return
            except DiskFull as exc:
                if not tries:
                    log.warning(
                        "job %s: its end waits for space on the disk (tried every %g s): %s", job_id, DISK_RETRY_S, exc
                    )
                self._ends_waiting[job_id] = exc
                await asyncio.sleep(DISK_RETRY_S)

    async def _pipeline(self, job_id: str, request: gateway_pb2.ResolvedRequest, attempt: int) -> None:
        workflow = workflows.by_value(request.workflow)
        assets = await self.assets.find(workflows.asset_ids(request))
        job = JobContext(
            job_id,
            request,
            workflow.media_items(request, assets.get),
            self.assets.read,
            functools.partial(self._emit, job_id),
        )
        for step in workflow.plan:
            stages = [self.caller.stages[name] for name in step]
            outputs = await all_of(*(self._stage(job, attempt, stage) for stage in stages))
            for stage, output in zip(stages, outputs, strict=True):  # in the plan's order, however the calls ended
                job.outputs[stage.name] = output
                for name, seconds in (await stage.finished(job, output)).items():
                    await self._set_stage_seconds(job.job_id, name, seconds)
        await self._complete(job)

    async def _set_stage_seconds(self, job_id: str, stage: str, seconds: float) -> None:
        await self._patiently(
            job_id, lambda: self.store.set_stage_seconds(job_id, stage, seconds, lease=self._lease(job_id))
        )

    async def _stage(self, job: JobContext, attempt: int, stage: Stage) -> StageOutput:
        """Wait for a worker of `stage`, run its call, record the pass."""
        job_id = job.job_id
        record_id = await self._patiently(
            job_id, lambda: self.store.stage_enqueued(job_id, attempt, stage.name, lease=self._lease(job_id))
        )
        waited = time.monotonic()
        async with (
            self.queues[stage.name].worker(),
            self.card.turn(job, stage.name) if self.card else contextlib.nullcontext(),
        ):
            started = time.monotonic()
            self.metrics.queue_seconds.labels(stage.name).observe(started - waited)
            now = time.time()
            await self._patiently(
                job_id, lambda: self.store.stage_update(record_id, lease=self._lease(job_id), started=now)
            )
            record = CallRecord()
            try:
                output = await self.caller.run(stage, job, record, Watchdog(self.stall_s))
            except BaseException as exc:
                if isinstance(exc, Fenced):  # the job's record is not this gateway's to write any more
                    raise
                ended = dict(replica=record.replica, tries=record.tries, error=self._reason(job_id, exc))
                await self._patiently(
                    job_id, lambda: self.store.stage_update(record_id, lease=self._lease(job_id), **ended)
                )
                raise
            done = dict(
                finished=time.time(),
                replica=record.replica,
                tries=record.tries,
                bytes_in=record.bytes_in,
                bytes_out=record.bytes_out,
            )
            await self._patiently(job_id, lambda: self.store.stage_update(record_id, lease=self._lease(job_id), **done))
            self.metrics.stage_seconds.labels(stage.name).observe(time.monotonic() - started)
        return output

    def _reason(self, job_id: str, exc: BaseException) -> str:
        """Why a stage pass ended without a result, for its record."""
        if isinstance(exc, asyncio.CancelledError):
            return CANCELLED_BY_CLIENT if job_id in self._cancel_requested else "the gateway shut down"
        return tail(str(exc) or type(exc).__name__)

    async def _complete(self, job: JobContext) -> None:
        decoded = job.outputs["vae"]
        video = await self._store_artifact_in_time(job, "video", decoded.files["video.mp4"])
        done = S.Done(video=video, duration_s=decoded.summary.duration_s)
        if "raw.npz" in decoded.files:
            done.raw.CopyFrom(await self._store_artifact_in_time(job, "raw", decoded.files["raw.npz"]))
        if video.sha256 != decoded.summary.sha256:
            raise RuntimeError(f"video.mp4 arrived with sha256 {video.sha256}, the VAE sent {decoded.summary.sha256}")
        await self._finish(job.job_id, S.JOB_STATE_SUCCEEDED, done=done)
        await self.retention.enforce()

    async def _store_artifact_in_time(self, job: JobContext, kind: str, data: BytesLike) -> gateway_pb2.Artifact:
        """Store the artifact; while the disk cannot hold it, wait for space (trying every DISK_RETRY_S, the job's
        `waiting` event saying where, what is free and what it needs) up to `space_wait_s`, then fail naming the
        disk. A finished clip is minutes of GPU time: a disk full for a while must not throw it away."""
        deadline, said = 0.0, False
        while True:
            try:
                return await self._store_artifact(job.job_id, kind, data)
            except DiskFull as exc:
                if not deadline:
                    deadline = time.monotonic() + self.space_wait_s
                    log.warning(
                        "job %s: its %s waits for space, up to %g s: %s", job.job_id, kind, self.space_wait_s, exc
                    )
                if time.monotonic() >= deadline:
                    raise
                said = said or await self._say_waiting_for_space(job, memoryview(data).nbytes)
            await asyncio.sleep(DISK_RETRY_S)

    async def _say_waiting_for_space(self, job: JobContext, needed: int) -> bool:
        """The job's `waiting` event for the artifacts' disk; False when the store, on the same full disk, could not
        keep it either (then it is tried again at the next try)."""
        reason = space_wanted(self.artifacts.disk, needed)
        try:
            await job.emit(waiting=S.Waiting(stage=ARTIFACTS_STAGE, reason=reason, limit_s=self.space_wait_s))
        except DiskFull:
            return False
        return True

    async def _store_artifact(self, job_id: str, kind: str, data: BytesLike) -> gateway_pb2.Artifact:
        """Write the job's `kind` artifact and record it. A file whose record failed (rolled back) is removed: the
        retention policy goes by the records and would never remove it."""
        artifact, key = await asyncio.to_thread(self.artifacts.save, job_id, kind, data)
        try:
            await self._patiently(
                job_id, lambda: self.store.add_artifact(job_id, kind, artifact, key, lease=self._lease(job_id))
            )
        except Exception:
            await asyncio.to_thread(self.artifacts.remove, key)
            raise
        return artifact


def _by_client() -> gateway_pb2.Cancelled:
    return S.Cancelled(reason=CANCELLED_BY_CLIENT)


def _where(stage: str) -> str:
    return f"the {stage} stage" if stage else "the queue"
