"""DiT service: conditioning tensors in, one progress event per denoise step, latents out.

One request runs at a time (the schedulers hold per-request state); a second one waits for
the first. A client that cancels stops the loop at the next step boundary.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from h3serve.v1 import common_pb2, dit_pb2, dit_pb2_grpc
from services.common import fastpath, wire
from services.common.config import ModelServiceConfig
from services.common.errors import describe
from services.common.pump import ClientGone, pump
from services.common.runtime import load_model_service
from services.common.server import run_server
from services.dit import workflows as wf
from services.dit.runner import DenoiseJob, DenoiseRunner, StepClock

log = logging.getLogger("h3serve.dit")


def job_from_spec(spec: dit_pb2.DenoiseSpec, served: list[int]) -> DenoiseJob:
    workflow = spec.workflow or common_pb2.WORKFLOW_T2VA
    if workflow not in served:
        names = ", ".join(common_pb2.Workflow.Name(w) for w in served)
        raise ValueError(f"workflow: {common_pb2.Workflow.Name(workflow)} is not served by this DiT (serves {names})")
    return DenoiseJob(spec.height, spec.width, spec.num_frames, spec.num_inference_steps, spec.seed, workflow)


class DiTServicer(dit_pb2_grpc.DiTServicer):
    def __init__(self, runner: DenoiseRunner, model: common_pb2.ModelInfo, attention_backend: str) -> None:
        self.runner = runner
        self.workflows = list(runner.pipes)
        self.model = model
        self.attention_backend = attention_backend
        self._lock = threading.Lock()
        self.requests_served = 0
        self.steps_served = 0

    def Denoise(self, request_iterator, context):
        try:
            spec, tensors = wire.read_spec_stream(request_iterator, wf.tensor_names)
            job = job_from_spec(spec, self.workflows)
            conditioning = wf.Conditioning.from_spec(spec, tensors)
        except ValueError as exc:  # WireError included
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        cancelled = threading.Event()
        context.add_callback(cancelled.set)
        try:
            summary = yield from pump(lambda emit: self._run(spec.job_id, job, tensors, conditioning, cancelled, emit))
        except ClientGone:
            log.info("job %s: cancelled by the client at a step boundary", spec.job_id)
            return
        except ValueError as exc:  # the model's own validation of the request
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, describe(exc, lines=1))
        except Exception as exc:
            log.exception("job %s: denoise failed", spec.job_id)
            context.abort(grpc.StatusCode.INTERNAL, describe(exc))
        yield dit_pb2.DenoiseEvent(summary=summary)

    def _run(self, job_id: str, job: DenoiseJob, tensors: dict, conditioning: wf.Conditioning,
             cancelled: threading.Event, emit):
        waited = time.perf_counter()
        while not self._lock.acquire(timeout=0.1):
            if cancelled.is_set():
                raise ClientGone
        try:
            queue_seconds = time.perf_counter() - waited
            started = time.perf_counter()
            clock = StepClock()

            def observe(step: int, total: int) -> None:
                emit(dit_pb2.DenoiseEvent(step=dit_pb2.StepProgress(step=step, total=total, seconds=clock.lap())))
                self.steps_served += 1
                if cancelled.is_set():
                    raise ClientGone

            latents = self.runner.run(job, tensors["prompt_embeds"], tensors["text_token_tags"], observe, conditioning)
            for chunk in wire.encode_many(latents):
                emit(dit_pb2.DenoiseEvent(chunk=chunk))
            self.requests_served += 1
            seconds = time.perf_counter() - started
            log.info("job %s: %d steps in %.2f s (waited %.2f s)", job_id, job.num_inference_steps - 1, seconds,
                     queue_seconds)
            video_rows, audio_rows = self.runner.condition_rows
            return dit_pb2.DenoiseSummary(seconds=seconds, queue_seconds=queue_seconds,
                                          steps=job.num_inference_steps - 1, condition_video_rows=video_rows,
                                          condition_audio_rows=audio_rows)
        finally:
            self._lock.release()

    def Info(self, request, context):
        return dit_pb2.DiTInfo(model=self.model, attention_backend=self.attention_backend,
                               requests_served=self.requests_served, steps_served=self.steps_served,
                               busy=self._lock.locked(), workflows=self.workflows,
                               partitions=wf.partitions(self.workflows))


def serve(config: ModelServiceConfig) -> None:
    served = wf.served(config.workflows)
    loaded = wf.partitions(served)
    components, model = load_model_service("dit", [*loaded, *wf.SCHEDULERS], config)
    for partition in loaded:
        fastpath.apply(components[partition], config.fast_path())
    log.info("workflows %s on %s", ", ".join(config.workflows), ", ".join(loaded))
    servicer = DiTServicer(DenoiseRunner(components, tuple(served)), model, config.attention_backend)
    run_server(lambda server: dit_pb2_grpc.add_DiTServicer_to_server(servicer, server),
               [dit_pb2.DESCRIPTOR.services_by_name["DiT"].full_name], config.address,
               tls=(config.tls_cert, config.tls_key))
