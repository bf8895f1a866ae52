"""Runs a job through the stages: encoder -> DiT -> VAE, turning stage progress into JobEvents.

Every job ends in exactly one terminal state, written to the store with its terminal event.
That is guaranteed by `_run`'s handlers and a final check, not by any single signal: a job
that somehow escaped them is still marked FAILED (the field notes' ghost "running" job).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc

from h3serve.v1 import dit_pb2, gateway_pb2, vae_pb2
from gateway.artifacts import ArtifactStore
from gateway.asset_store import AssetStore
from gateway.events import EventHub
from gateway.media_stage import encode_inputs
from gateway.stages import StageClients
from gateway.store import JobStore
from services.common.errors import describe, tail

log = logging.getLogger("h3serve.gateway.jobs")
S = gateway_pb2


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
    def __init__(self, store: JobStore, hub: EventHub, stages: StageClients, artifacts: ArtifactStore,
                 assets: AssetStore | None = None) -> None:
        self.store, self.hub, self.stages, self.artifacts, self.assets = store, hub, stages, artifacts, assets
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
        """Stop in-flight jobs without a verdict: a restart finds them interrupted and says so."""
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def _run(self, job_id: str, request: gateway_pb2.ResolvedRequest) -> None:
        try:
            self.store.set_state(job_id, S.JOB_STATE_RUNNING)
            await self._pipeline(job_id, request)
        except asyncio.CancelledError:
            if job_id not in self._cancel_requested:
                raise  # gateway shutdown: left in flight, failed explicitly at the next start
            self._finish(job_id, S.JOB_STATE_CANCELLED, cancelled=S.Cancelled(reason="cancelled by CancelJob"))
        except grpc.aio.AioRpcError as exc:
            self._finish(job_id, S.JOB_STATE_FAILED, failed=failure(exc.code(), exc.details() or str(exc)))
        except Exception as exc:
            log.exception("job %s failed", job_id)
            self._finish(job_id, S.JOB_STATE_FAILED, failed=failure(grpc.StatusCode.INTERNAL, describe(exc)))
        finally:
            self._cancel_requested.discard(job_id)

    def _finish(self, job_id: str, state: int, **terminal) -> None:
        error = terminal.get("failed")
        if self.store.set_state(job_id, state, error):
            self.hub.emit(job_id, **terminal)

    async def _pipeline(self, job_id: str, request: gateway_pb2.ResolvedRequest) -> None:
        inputs = await encode_inputs(self.stages, self.assets, job_id, request, self._condition_progress(job_id))
        encoded = inputs.encoded
        self.store.set_stage_seconds(job_id, "encode", encoded.summary.seconds)
        if inputs.conditions is not None:
            self.store.set_stage_seconds(job_id, "condition", inputs.conditions.seconds)
        self.hub.emit(job_id, encoding=S.Encoding(cache_hit=encoded.summary.cache_hit,
                                                  seconds=encoded.summary.seconds))

        steps = StepTimes()

        async def on_step(step: dit_pb2.StepProgress) -> None:
            self.hub.emit(job_id, denoising=steps.event(step))

        denoised = await self.stages.denoise(job_id, request, inputs.chunks, on_step, inputs.spec)
        self.store.set_stage_seconds(job_id, "denoise", denoised.summary.seconds)

        decoded = await self.stages.decode(job_id, request.include_raw, denoised.chunks,
                                           self._decode_progress(job_id))
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
