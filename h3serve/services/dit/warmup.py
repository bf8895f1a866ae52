"""Warm before SERVING: the group denoises each `[dit] warmup` shape once before health says SERVING.

A compiled transformer otherwise compiles inside a user's first request (seconds to minutes), and again at the
request's second forward, whose inputs differ from the first's. Each shape runs `warmup_steps` steps (3: both
forward variants) on synthetic text embeddings through the same checks and the same group broadcast as a
request, so every rank compiles what a request will run, and a shape that cannot run (memory, a kernel) stops
the start with its reason instead of failing a user's request.

With compile, each shape runs twice with two prompt lengths: the second length makes torch.compile mark the
packed sequence's dimension dynamic, so prompts of any length (and, on the tiny model on CPU, other canvases,
frame counts and step counts too) then run without compiling again (tests/test_warmup.py counts the graphs).
Without compile one run per shape is enough to load kernels and grow the allocator's pools.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from h3serve.common.config import DiTConfig, parse_shape
from h3serve.model import rules, workflows
from h3serve.services.dit import checks
from h3serve.services.dit.group import WARMUP, GroupMember, Message
from h3serve.services.dit.runner import served
from h3serve.v1 import common_pb2, dit_pb2

log = logging.getLogger("h3serve.dit.warmup")
PROMPT_TOKENS = (256, 77)  # two lengths with compile: the second makes the sequence dimension dynamic
SEED = 0
WORKFLOW = workflows.by_name("t2va")  # no media to make up; ref2va's partition is not warmed (config says so)


@dataclass(frozen=True)
class WarmRun:
    shape: str
    tokens: int
    seconds: float


def warm_up(member: GroupMember, config: DiTConfig) -> list[WarmRun]:
    """Denoise every warm-up shape on every rank (rank 0 broadcasts; the others follow); ValueError names a shape
    the service cannot run."""
    lengths = PROMPT_TOKENS if config.compile else PROMPT_TOKENS[:1]
    runs = []
    for shape in config.warmup:
        for tokens in lengths:
            message = warm_message(member, config, shape, tokens)
            started = time.perf_counter()
            member.control.broadcast(message)
            outcome = member.run(message, lambda step, total: None, lambda: False)
            if outcome.invalid is not None:
                raise ValueError(f"warmup {shape}: {outcome.invalid}")
            runs.append(WarmRun(shape, tokens, time.perf_counter() - started))
            log.info("warm-up %s with a %d-token prompt: %d steps in %.1f s", shape, tokens,
                     config.warmup_steps - 1, runs[-1].seconds)
    return runs


def warm_message(member: GroupMember, config: DiTConfig, shape: str, tokens: int) -> Message:
    """A t2va request of `shape` with random text embeddings of `tokens` rows, through the service's own checks."""
    height, width, frames = parse_shape(shape)
    spec = dit_pb2.DenoiseSpec(job_id=f"warmup-{shape}-{tokens}", workflow=WORKFLOW.value,
                               height=height, width=width, num_frames=frames,
                               params=common_pb2.GenerationParams(num_inference_steps=config.warmup_steps, seed=SEED))
    check = checks.DenoiseCheck(config, [flow.value for flow in served(config.workflows)],
                                lambda flow: checks.model_dims(member.runner, flow))
    check.expect(spec)
    generator = torch.Generator().manual_seed(SEED)
    text = {"prompt_embeds": torch.randn(1, tokens, check.dims.text_dim, generator=generator),
            "text_token_tags": torch.full((tokens,), rules.TEXT_TAG, dtype=torch.int64)}
    return Message(WARMUP, spec, text, check.conditioning(spec, text))
