"""Encoder service: prompt -> (prompt_embeds, text_token_tags), with an exact embedding cache."""

from __future__ import annotations

import logging
import time

import grpc

from h3serve.common.config import EncoderConfig
from h3serve.common.server import refuse_port_in_use, run_server
from h3serve.model.workflows.base import MediaError
from h3serve.runtime import memory, wire
from h3serve.runtime.checks import spec_checked
from h3serve.runtime.media import MediaPreparer, read_media_stream
from h3serve.runtime.service import check_host_memory, warm_up
from h3serve.services.encoder import checks, placement
from h3serve.services.encoder.cache import ByteLRU, media_key, prompt_key
from h3serve.services.encoder.runner import COMPONENTS, TextEncoderRunner
from h3serve.v1 import common_pb2, encoder_pb2, encoder_pb2_grpc

log = logging.getLogger("h3serve.encoder")


class EncoderServicer(encoder_pb2_grpc.EncoderServicer):
    def __init__(
        self,
        runner: TextEncoderRunner,
        model: common_pb2.ModelInfo,
        config: EncoderConfig,
        cache: ByteLRU | None = None,
    ) -> None:
        self.runner = runner
        self.model = model
        self.config = config
        self.variant = placement.variant(config)  # in every cache key: int8 / nf4 embeddings are not bf16 ones
        self.cache = cache if cache is not None else ByteLRU(config.cache_bytes)
        self.media = MediaPreparer(config.geometry)
        self.tokens = checks.TokenCounter(runner.tokenizer)

    def Encode(self, request, context):
        try:
            checks.check_encode(request, self.config, self.tokens)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        yield from self._cached(
            request.job_id,
            prompt_key(self.model.model_revision, self.variant, request.prompt),
            lambda: self.runner.encode(request.prompt, common_pb2.WORKFLOW_T2VA),
        )

    def EncodeMedia(self, request_iterator, context):
        """fl2va / ref2va: the cache key holds the canvas, the frame count and the assets' content addresses."""
        try:
            with wire.refusal_heard(request_iterator):
                spec, assets = read_media_stream(
                    spec_checked(request_iterator, lambda spec: checks.check_media(spec, self.config, self.tokens))
                )
        except ValueError as exc:  # MediaError included
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        key = media_key(self.model.model_revision, self.variant, spec)
        try:
            yield from self._cached(
                spec.job_id,
                key,
                lambda: self.runner.encode(spec.prompt, spec.workflow, self.media.prepare(spec, assets)),
            )
        except MediaError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def _cached(self, job_id: str, key: tuple, encode):
        started = time.perf_counter()
        chunks = self.cache.get(key)
        hit = chunks is not None
        if not hit:
            try:
                tensors = encode()
            finally:
                # As the DiT and the VAE do after every request: the allocator's cache (the streamed layers and the
                # activations, 3.3 GiB on one H100) goes back to the driver, for a stage that shares this card
                memory.release(self.config.device)
            chunks = list(wire.encode_many(tensors))
            self.cache.put(key, chunks, sum(t.nbytes for t in tensors.values()))
        for chunk in chunks:
            yield encoder_pb2.EncodeReply(chunk=chunk)
        num_tokens = chunks[0].tensor.shape[1]
        yield encoder_pb2.EncodeReply(
            summary=encoder_pb2.EncodeSummary(
                cache_hit=hit,
                seconds=time.perf_counter() - started,
                model_revision=self.model.model_revision,
                num_tokens=num_tokens,
            )
        )
        log.info(
            "job %s: encoded %d tokens (%s) in %.3f s",
            job_id,
            num_tokens,
            "cache hit" if hit else "cache miss",
            time.perf_counter() - started,
        )

    def Info(self, request, context):
        stats = self.cache.stats()
        return encoder_pb2.EncoderInfo(
            model=self.model,
            cache_entries=stats.entries,
            cache_bytes=stats.bytes,
            cache_capacity_bytes=self.cache.capacity_bytes,
            cache_hits=stats.hits,
            cache_misses=stats.misses,
            cache_evictions=stats.evictions,
            model_runs=self.runner.runs,
            max_prompt_chars=self.config.max_prompt_chars,
        )


def serve(config: EncoderConfig) -> None:
    refuse_port_in_use(config.address)  # before minutes of loading: a restart would not free the port
    try:
        placement.check(config)  # before any weight is loaded
        check_host_memory("encoder", config)
        components, model = placement.load(config, COMPONENTS)  # spread refuses a model the GPUs cannot hold
    except ValueError as exc:
        raise SystemExit(f"h3serve serve encoder: {exc}") from exc
    runner = TextEncoderRunner(components)
    warm_up("encoder", runner.warm_up)
    memory.release(config.device)
    servicer = EncoderServicer(runner, model, config)
    run_server(
        lambda server: encoder_pb2_grpc.add_EncoderServicer_to_server(servicer, server),
        [encoder_pb2.DESCRIPTOR.services_by_name["Encoder"].full_name],
        config.address,
        tls=(config.tls_cert, config.tls_key),
        auth_token=config.auth_token,
    )
