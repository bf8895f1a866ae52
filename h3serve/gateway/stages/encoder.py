"""The `encoder` stage: the prompt (with the workflow's keyframes / references) to prompt embeddings."""

from __future__ import annotations

from h3serve.gateway.metrics import GatewayMetrics
from h3serve.gateway.stages.media import media_bytes, media_spec, media_stream
from h3serve.gateway.stages.stage import JobContext, Request, Stage, StageOutput
from h3serve.v1 import encoder_pb2, encoder_pb2_grpc, gateway_pb2


class EncodeStage(Stage):
    name, service, phase, deadline = "encoder", "encoder", "encode", "encode_deadline_s"
    stub = encoder_pb2_grpc.EncoderStub

    def __init__(self, metrics: GatewayMetrics) -> None:
        super().__init__(metrics)
        self.hits = self.misses = 0

    def request(self, job: JobContext) -> Request:
        if job.media:
            spec = media_spec(job, with_prompt=True)
            return Request("EncodeMedia", lambda: media_stream(spec, job), media_bytes(job))
        message = encoder_pb2.EncodeRequest(prompt=job.request.prompt, job_id=job.job_id)
        return Request("Encode", lambda: message, len(job.request.prompt.encode("utf-8")))

    async def finished(self, job: JobContext, output: StageOutput) -> dict[str, float]:
        summary = output.summary
        self.hits, self.misses = self.hits + summary.cache_hit, self.misses + (not summary.cache_hit)
        self.metrics.cache.labels("hit" if summary.cache_hit else "miss").inc()
        await job.emit(encoding=gateway_pb2.Encoding(cache_hit=summary.cache_hit, seconds=summary.seconds))
        return {"encode": summary.seconds}

    def cache_hit_rate(self) -> float:
        calls = self.hits + self.misses
        return self.hits / calls if calls else 0.0
