"""Runs a job through the stages: encoder -> DiT -> VAE, turning stage progress into JobEvents.

Each stage has its own queue and workers (`StageQueue`), so jobs overlap across stages. Every pass
through a stage is recorded (queued, started, finished, replica, bytes). A stalled stage makes the
job run again from the start (same seed, same result) while attempts remain.

Every job ends in exactly one terminal state, written to the store with its terminal event.
That is guaranteed by `_run`'s handlers, not by any single signal: a job that escaped the
expected errors is still marked FAILED (the field notes' ghost "running" job).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from h3serve.v1 import dit_pb2, gateway_pb2, vae_pb2
from h3serve.gateway.jobs.artifacts import ArtifactStore
from h3serve.gateway.assets.store import AssetStore
from h3serve.gateway.jobs.events import EventHub
from h3serve.gateway.stages.media import encode_inputs
from h3serve.gateway.metrics import STAGES, GatewayMetrics
from h3serve.gateway.jobs.retention import Retention
from h3serve.gateway.stages.queue import StageQueue
from h3serve.gateway.stages.calls import CallRecord, StageClients
from h3serve.gateway.jobs.store import JobStore
from h3serve.gateway.stages.watchdog import Stuck, Watchdog
from h3serve.common.config import GatewayConfig
from h3serve.common.errors import describe, tail

log = logging.getLogger("h3serve.gateway.jobs")
S = gateway_pb2


T = TypeVar("T")
VAE_ENCODE = "vae-encode"
REPLICAS_OF = {VAE_ENCODE: "vae"}  # a stage that runs on another stage's replicas


class StageFailed(Exception):
    """A stage call ended with a gRPC error; the message names the stage and the replica."""

    def __init__(self, stage: str, replica: str, error: grpc.aio.AioRpcError):
        self.code = error.code()
        super().__init__(f"{stage} ({replica}): {error.details() or error.code().name}")


def _reason(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return tail(f"{exc.code().name}: {exc.details()}")
    return tail(str(exc) or type(exc).__name__)


def failure(code: grpc.StatusCode, message: str) -> gateway_pb2.Failed:
    return S.Failed(code=code.value[0], code_name=code.name, message=tail(message))


@dataclass
class StepTimes:
    """Denoise progress of one job, for elapsed time and ETA."""

    elapsed: float = 0.0

    def event(self, step: dit_pb2.StepProgress) -> gateway_pb2.Denoising:
        self.elapsed += step.seconds
        eta = self.elapsed / step.step * (step.total - step.step)
        return S.Denoising(step=step.step, total=step.total, step_seconds=step.seconds,
                           elapsed_seconds=self.elapsed, eta_seconds=eta)


class JobRunner:
    def __init__(self, config: GatewayConfig, store: JobStore, hub: EventHub, stages: StageClients,
                 artifacts: ArtifactStore, metrics: GatewayMetrics, assets: AssetStore | None = None) -> None:
        self.store, self.hub, self.stages, self.artifacts, self.metrics = store, hub, stages, artifacts, metrics
        self.assets = assets
        self.max_attempts, self.stall_s = config.max_attempts, config.stall_s
        # One queue per stage; "vae-encode" (fl2va/ref2va conditioning) runs on the VAE replicas.
        self.queues = {stage: StageQueue(stage, len(config.replicas(stage))) for stage in STAGES}
        self.queues[VAE_ENCODE] = StageQueue(VAE_ENCODE, len(config.replicas(REPLICAS_OF[VAE_ENCODE])))
        self.retention = Retention(store, config.artifact_max_age_s, config.artifact_max_bytes)
        self._tasks: dict[str, asyncio.Task] = {}
        self._cancel_requested: set[str] = set()

    def start(self, job_id: str, request: gateway_pb2.ResolvedRequest) -> None:
        task = asyncio.get_running_loop().create_task(self._run(job_id, request), name=f"job-{job_id}")
        self._tasks[job_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(job_id, None))

    def cancel(self, job_id: str) -> bool:
        """Ask a running job to stop; its stage call is cancelled, the DiT stops at a step boundary."""
        task = self._tasks.get(job_id)
        if task is None:
            return False
        self._cancel_requested.add(job_id)
        task.cancel()
        return True

    async def shutdown(self) -> None:
        """Stop in-flight jobs without a verdict: they go back to the queue, their attempt not counted, and the
        next start runs them again."""
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def _run(self, job_id: str, request: gateway_pb2.ResolvedRequest) -> None:
        try:
            while attempt := self.store.start_attempt(job_id):
                if await self._attempt(job_id, request, attempt):
                    return
        except asyncio.CancelledError:
            if job_id not in self._cancel_requested:  # gateway shutdown: run again at the next start
                event = self.store.requeue_after_shutdown(job_id, self.max_attempts)
                if event is not None:
                    self.hub.publish(event)
                raise
            self._finish(job_id, S.JOB_STATE_CANCELLED, cancelled=S.Cancelled(reason="cancelled by CancelJob"))
        except StageFailed as exc:
            self._finish(job_id, S.JOB_STATE_FAILED, failed=failure(exc.code, str(exc)))
        except Exception as exc:
            log.exception("job %s failed", job_id)
            self._finish(job_id, S.JOB_STATE_FAILED, failed=failure(grpc.StatusCode.INTERNAL, describe(exc)))
        finally:
            self._cancel_requested.discard(job_id)

    async def _attempt(self, job_id: str, request: gateway_pb2.ResolvedRequest, attempt: int) -> bool:
        """One run from the start; False when it stalled and the job was queued for another attempt."""
        try:
            await self._pipeline(job_id, request, attempt)
            return True
        except Stuck as exc:
            self.metrics.stalls.labels(exc.phase).inc()
            log.warning("job %s attempt %d: %s", job_id, attempt, exc)
            event = self.store.retry_or_fail(job_id, self.max_attempts, str(exc), grpc.StatusCode.DEADLINE_EXCEEDED)
            if event is None:
                return True
            self.hub.publish(event)
            if event.HasField("failed"):
                return True
            self.metrics.job_retries.labels("stall").inc()
            return False

    def _finish(self, job_id: str, state: int, **terminal) -> None:
        error = terminal.get("failed")
        if self.store.set_state(job_id, state, error):
            self.hub.emit(job_id, **terminal)

    async def _stage(self, job_id: str, attempt: int, stage: str, work: Callable[[CallRecord], Awaitable[T]]) -> T:
        """Wait for a worker of `stage`, run `work`, and record the pass."""
        record_id = self.store.stage_enqueued(job_id, attempt, stage)
        waited = time.monotonic()
        async with self.queues[stage].worker():
            started = time.monotonic()
            self.metrics.queue_seconds.labels(stage).observe(started - waited)
            self.store.stage_update(record_id, started=time.time())
            call = CallRecord()
            try:
                result = await work(call)
            except BaseException as exc:
                self.store.stage_update(record_id, replica=call.replica, tries=call.tries, error=_reason(exc))
                if isinstance(exc, grpc.aio.AioRpcError):
                    raise StageFailed(stage, call.replica, exc) from exc
                raise
            self.store.stage_update(record_id, finished=time.time(), replica=call.replica, tries=call.tries,
                                    bytes_in=call.bytes_in, bytes_out=call.bytes_out)
            self.metrics.stage_seconds.labels(stage).observe(time.monotonic() - started)
        return result

    async def _pipeline(self, job_id: str, request: gateway_pb2.ResolvedRequest, attempt: int) -> None:
        inputs = await encode_inputs(self.stages, self.assets, job_id, request, self._condition_progress(job_id),
                                     lambda stage, work: self._stage(job_id, attempt, stage, work), self.stall_s)
        encoded = inputs.encoded
        self.store.set_stage_seconds(job_id, "encode", encoded.summary.seconds)
        if inputs.conditions is not None:
            self.store.set_stage_seconds(job_id, "condition", inputs.conditions.seconds)
        self.hub.emit(job_id, encoding=S.Encoding(cache_hit=encoded.summary.cache_hit,
                                                  seconds=encoded.summary.seconds))

        steps = StepTimes()

        async def on_step(step: dit_pb2.StepProgress) -> None:
            self.hub.emit(job_id, denoising=steps.event(step))

        denoised = await self._stage(job_id, attempt, "dit", lambda call: self.stages.denoise(
            job_id, request, inputs.chunks, on_step, Watchdog(self.stall_s), call, inputs.spec))
        self.store.set_stage_seconds(job_id, "denoise", denoised.summary.seconds)

        decoded = await self._stage(job_id, attempt, "vae", lambda call: self.stages.decode(
            job_id, request.include_raw, denoised.chunks, self._decode_progress(job_id), Watchdog(self.stall_s), call))
        self.store.set_stage_seconds(job_id, "decode", decoded.summary.decode_seconds)
        self.store.set_stage_seconds(job_id, "mux", decoded.summary.mux_seconds)
        self._complete(job_id, decoded)

    def _condition_progress(self, job_id: str):
        async def on_progress(progress: vae_pb2.ConditionProgress) -> None:
            self.hub.emit(job_id, conditioning=S.Conditioning(done=progress.done, total=progress.total))

        return on_progress

    def _decode_progress(self, job_id: str):
        video_total = 0

        async def on_progress(progress: vae_pb2.DecodeProgress) -> None:
            nonlocal video_total
            if progress.phase == vae_pb2.DECODE_PHASE_VIDEO:
                video_total = progress.total
                self.hub.emit(job_id, decoding=S.Decoding(chunk=progress.done, total=video_total + 1))
            elif progress.phase == vae_pb2.DECODE_PHASE_AUDIO:
                self.hub.emit(job_id, decoding=S.Decoding(chunk=video_total + 1, total=video_total + 1))
            else:
                self.hub.emit(job_id, muxing=S.Muxing(done=progress.done, total=progress.total))

        return on_progress

    def _complete(self, job_id: str, decoded) -> None:
        video, path = self.artifacts.save(job_id, "video", decoded.files["video.mp4"])
        self.store.add_artifact(job_id, "video", video, path)
        done = S.Done(video=video, duration_s=decoded.summary.duration_s)
        if "raw.npz" in decoded.files:
            raw, raw_path = self.artifacts.save(job_id, "raw", decoded.files["raw.npz"])
            self.store.add_artifact(job_id, "raw", raw, raw_path)
            done.raw.CopyFrom(raw)
        if video.sha256 != decoded.summary.sha256:
            raise RuntimeError(f"video.mp4 arrived with sha256 {video.sha256}, the VAE sent {decoded.summary.sha256}")
        self._finish(job_id, S.JOB_STATE_SUCCEEDED, done=done)
        self.retention.enforce()
