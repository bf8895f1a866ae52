"""Encoder service: prompt -> (prompt_embeds, text_token_tags), with an exact embedding cache."""

from __future__ import annotations

import logging
import time

import grpc

from h3serve.v1 import common_pb2, encoder_pb2, encoder_pb2_grpc
from services.common import wire
from services.common.config import ModelServiceConfig
from services.common.runtime import load_model_service
from services.common.server import run_server
from services.encoder.cache import ByteLRU
from services.encoder.runner import COMPONENTS, TextEncoderRunner

log = logging.getLogger("h3serve.encoder")


class EncoderServicer(encoder_pb2_grpc.EncoderServicer):
    def __init__(self, runner: TextEncoderRunner, model: common_pb2.ModelInfo, config: ModelServiceConfig) -> None:
        self.runner = runner
        self.model = model
        self.config = config
        self.cache = ByteLRU(config.cache_bytes)

    def Encode(self, request, context):
        started = time.perf_counter()
        prompt = request.prompt
        if not prompt.strip():
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt: must not be empty")
        if len(prompt) > self.config.max_prompt_chars:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"prompt: {len(prompt)} characters, at most {self.config.max_prompt_chars} allowed")
        key = (self.model.model_revision, prompt)
        chunks = self.cache.get(key)
        hit = chunks is not None
        if not hit:
            tensors = self.runner.encode(prompt)
            chunks = list(wire.encode_many(tensors))
            self.cache.put(key, chunks, sum(t.nbytes for t in tensors.values()))
        for chunk in chunks:
            yield encoder_pb2.EncodeReply(chunk=chunk)
        num_tokens = chunks[0].tensor.shape[1]
        yield encoder_pb2.EncodeReply(summary=encoder_pb2.EncodeSummary(
            cache_hit=hit, seconds=time.perf_counter() - started,
            model_revision=self.model.model_revision, num_tokens=num_tokens))
        log.info("job %s: encoded %d tokens (%s) in %.3f s", request.job_id, num_tokens,
                 "cache hit" if hit else "cache miss", time.perf_counter() - started)

    def Info(self, request, context):
        stats = self.cache.stats()
        return encoder_pb2.EncoderInfo(
            model=self.model, cache_entries=stats.entries, cache_bytes=stats.bytes,
            cache_capacity_bytes=self.cache.capacity_bytes, cache_hits=stats.hits, cache_misses=stats.misses,
            cache_evictions=stats.evictions, model_runs=self.runner.runs,
            max_prompt_chars=self.config.max_prompt_chars)


def serve(config: ModelServiceConfig) -> None:
    components, model = load_model_service("encoder", COMPONENTS, config)
    servicer = EncoderServicer(TextEncoderRunner(components), model, config)
    run_server(lambda server: encoder_pb2_grpc.add_EncoderServicer_to_server(servicer, server),
               [encoder_pb2.DESCRIPTOR.services_by_name["Encoder"].full_name], config.address,
               tls=(config.tls_cert, config.tls_key))
