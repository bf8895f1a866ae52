"""The `vae` stage: latents to the validated MP4 (and the raw frames when asked), decode then mux progress."""

from __future__ import annotations

from h3serve.gateway.stages.stage import JobContext, Request, Stage, StageOutput
from h3serve.gateway.stages.watchdog import Watchdog
from h3serve.v1 import gateway_pb2, vae_pb2, vae_pb2_grpc


class DecodeStage(Stage):
    name, service, phase, deadline = "vae", "vae", "decode", "decode_deadline_s"
    stub = vae_pb2_grpc.VAEStub

    def request(self, job: JobContext) -> Request:
        latents = job.outputs["dit"].chunks
        spec = vae_pb2.DecodeSpec(job_id=job.job_id, params=job.request.params)
        inputs = [vae_pb2.DecodeInput(spec=spec), *(vae_pb2.DecodeInput(chunk=c) for c in latents)]
        return Request("Decode", lambda: iter(inputs), sum(len(c.tensor.data) for c in latents))

    async def progress(self, job: JobContext, kind: str, event, watchdog: Watchdog) -> None:
        """Video decoder calls, then the audio decode, count as one `decoding` sequence; then `muxing`."""
        if event.phase == vae_pb2.DECODE_PHASE_MUX:
            watchdog.progress("mux")
            await job.emit(muxing=gateway_pb2.Muxing(done=event.done, total=event.total))
            return
        watchdog.progress(self.phase)
        if event.phase == vae_pb2.DECODE_PHASE_VIDEO:
            job.scratch[self.name] = total = event.total + 1
            await job.emit(decoding=gateway_pb2.Decoding(chunk=event.done, total=total))
        else:
            total = job.scratch.get(self.name, 1)
            await job.emit(decoding=gateway_pb2.Decoding(chunk=total, total=total))

    async def finished(self, job: JobContext, output: StageOutput) -> dict[str, float]:
        return {"decode": output.summary.decode_seconds, "mux": output.summary.mux_seconds}
