"""The `vae-encode` stage (fl2va / ref2va): keyframes / references to conditioning latents, on the VAE replicas."""

from __future__ import annotations

from h3serve.gateway.stages.media import media_bytes, media_spec, media_stream
from h3serve.gateway.stages.stage import JobContext, Request, Stage, StageOutput
from h3serve.gateway.stages.watchdog import Watchdog
from h3serve.v1 import gateway_pb2, vae_pb2_grpc


class ConditionStage(Stage):
    name, service, phase, deadline = "vae-encode", "vae", "encode", "encode_deadline_s"
    stub = vae_pb2_grpc.VAEStub

    def request(self, job: JobContext) -> Request:
        spec = media_spec(job, with_prompt=False)  # the VAE has no use for the prompt
        return Request("EncodeConditions", lambda: media_stream(spec, job), media_bytes(job))

    async def progress(self, job: JobContext, kind: str, event, watchdog: Watchdog) -> None:
        watchdog.progress(self.phase)
        await job.emit(conditioning=gateway_pb2.Conditioning(done=event.done, total=event.total))

    async def finished(self, job: JobContext, output: StageOutput) -> dict[str, float]:
        return {"condition": output.summary.seconds}
