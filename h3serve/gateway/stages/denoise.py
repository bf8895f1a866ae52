"""The `dit` stage: prompt embeddings (and conditioning latents) to latents, one progress event per step."""

from __future__ import annotations

from dataclasses import dataclass

from h3serve.gateway.stages.stage import JobContext, Request, Stage, StageOutput
from h3serve.gateway.stages.watchdog import Watchdog
from h3serve.v1 import dit_pb2, dit_pb2_grpc, gateway_pb2


@dataclass
class StepTimes:
    """Denoise progress of one job, for elapsed time and ETA; steps that compiled are left out of the ETA's mean
    while any step did not (compiling costs a shape's first steps minutes, its later ones nothing)."""

    elapsed: float = 0.0
    plain_seconds: float = 0.0  # of the steps that compiled nothing
    plain_steps: int = 0

    def event(self, step: dit_pb2.StepProgress) -> gateway_pb2.Denoising:
        self.elapsed += step.seconds
        if not step.compiled_graphs:
            self.plain_seconds, self.plain_steps = self.plain_seconds + step.seconds, self.plain_steps + 1
        mean = self.plain_seconds / self.plain_steps if self.plain_steps else self.elapsed / step.step
        return gateway_pb2.Denoising(
            step=step.step,
            total=step.total,
            step_seconds=step.seconds,
            elapsed_seconds=self.elapsed,
            eta_seconds=mean * (step.total - step.step),
            compiled_graphs=step.compiled_graphs,
        )


class DenoiseStage(Stage):
    name, service, phase, deadline = "dit", "dit", "denoise", "denoise_deadline_s"
    stub = dit_pb2_grpc.DiTStub

    def request(self, job: JobContext) -> Request:
        request = job.request
        spec = dit_pb2.DenoiseSpec(
            job_id=job.job_id,
            workflow=request.workflow,
            height=request.height,
            width=request.width,
            num_frames=request.num_frames,
            params=request.params,
        )
        chunks = list(job.outputs["encoder"].chunks)
        conditions = job.outputs.get("vae-encode")
        if conditions is not None:  # the manifest the VAE made of the media, and their latents
            spec.keyframe_anchors.extend(conditions.summary.keyframe_anchors)
            spec.references.extend(conditions.summary.references)
            chunks += conditions.chunks
        inputs = [dit_pb2.DenoiseInput(spec=spec), *(dit_pb2.DenoiseInput(chunk=c) for c in chunks)]
        return Request("Denoise", lambda: iter(inputs), sum(len(c.tensor.data) for c in chunks))

    async def progress(self, job: JobContext, kind: str, event, watchdog: Watchdog) -> None:
        watchdog.progress(self.phase)
        self.metrics.step_seconds.observe(event.seconds)
        self.metrics.compiled_graphs.inc(event.compiled_graphs)
        await job.emit(denoising=job.scratch.setdefault(self.name, StepTimes()).event(event))

    async def finished(self, job: JobContext, output: StageOutput) -> dict[str, float]:
        return {"denoise": output.summary.seconds}
