"""Warm before SERVING: the group denoises each `[dit] warmup` shape once before health says SERVING.

A compiled transformer otherwise compiles inside a user's first request (seconds to minutes), and again at the
request's second forward, whose inputs differ from the first's. Each shape runs `steps(config)` steps on synthetic
text embeddings through the same checks and the same group broadcast as a request, so every rank compiles what a
request will run, and a shape that cannot run (memory, a kernel) stops the start with its reason instead of failing
a user's request.

With a dynamic compile one rank runs each shape once; a group that splits the sequence over ranks runs prompt lengths
of every residue modulo twice its ranks, as it meets new graphs when its ranks' chunks change parity (2 gloo ranks: at
the first two lengths only, tests/dist_checks.py); a static compile runs more (`prompt_lengths`). After
that, prompts of any length (and, on the tiny model on CPU, other canvases, frame counts and step counts too) run
without compiling again (tests/test_warmup.py counts the graphs; the last warm-up run's count is logged). Without
compile one run per shape is enough to load kernels and grow the allocator's pools.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from h3serve.common.config import DiTConfig, parse_shape
from h3serve.model import rules, workflows
from h3serve.model.adapters import AdapterCatalog
from h3serve.runtime import compile_cache, memory
from h3serve.services.dit import checks
from h3serve.services.dit.group import WARMUP, GroupMember, Message
from h3serve.services.dit.runner import served
from h3serve.v1 import common_pb2, dit_pb2

log = logging.getLogger("h3serve.dit.warmup")
PROMPT_TOKENS = 256  # the warm-up prompt's length; with compile, the next ones are shorter by 1, 2, ...
SEED = 0
WORKFLOW = workflows.by_name("t2va")  # no media to make up; ref2va's partition is not warmed (config says so)


@dataclass(frozen=True)
class WarmRun:
    shape: str
    tokens: int
    seconds: float
    compiled: int  # graphs torch.compile built during the run (rank 0's)


def warm_up(member: GroupMember, config: DiTConfig) -> list[WarmRun]:
    """Denoise every warm-up shape on every rank (rank 0 broadcasts; the others follow); ValueError names a shape
    the service cannot run."""
    runs, lengths = [], prompt_lengths(config)
    for shape in config.warmup:
        runs += [warm_run(member, config, shape, tokens) for tokens in lengths]
        if config.compile and len(lengths) > 1 and runs[-1].compiled:  # one length is the compile itself
            log.warning(
                "warm-up %s: its last prompt length still compiled %d graphs; a request of this shape may "
                "compile (its events say so)",
                shape,
                runs[-1].compiled,
            )
    if config.compile:
        log.info("warm-up done: %s", compile_cache.time_report())
    log.info("warm-up: GPU memory %s", memory.peaks(member.device))
    return runs


def steps(config: DiTConfig) -> int:
    """`warmup_steps`, else 2 (one forward) for a dynamic compile on one rank: its one graph per block serves both
    forward variants (the noise-level rows are unbacked, h3serve/runtime/fastpath.py), so a second forward would only
    repeat the work (tests/test_fastpath.py); else 3, which runs both variants."""
    if config.warmup_steps is not None:
        return config.warmup_steps
    return 2 if config.compile and config.compile_dynamic and config.world_size == 1 else 3


def prompt_lengths(config: DiTConfig) -> list[int]:
    """Without compile one length. With a dynamic compile on one rank one length too: its graphs take any packed length
    (tests/test_fastpath.py; on one H200 at 768x1344x124 a second length compiled nothing and cost 11.2 s of every
    start). A group that splits the sequence takes one per residue of the packed length modulo twice its ranks (it
    compiles its odd and even per-rank chunks apart: tests/dist_checks.py). A static first compile takes one length
    more, which makes torch.compile mark the packed sequence's dimension dynamic, and then one that should compile
    nothing."""
    if not config.compile:
        return [PROMPT_TOKENS]
    residues = 2 * config.world_size if config.world_size > 1 else 1
    count = residues if config.compile_dynamic else max(residues, 2) + 1
    return [PROMPT_TOKENS - k for k in range(count)]


def warm_run(member: GroupMember, config: DiTConfig, shape: str, tokens: int) -> WarmRun:
    message = warm_message(member, config, shape, tokens)
    started, graphs = time.perf_counter(), compile_cache.compiled_graphs()
    member.control.broadcast(message)
    outcome = member.run(message, lambda step, total: None, lambda: False)
    if outcome.invalid is not None:
        raise ValueError(f"warmup {shape}: {outcome.invalid}")
    run = WarmRun(shape, tokens, time.perf_counter() - started, compile_cache.compiled_graphs() - graphs)
    log.info(
        "warm-up %s with a %d-token prompt: %d steps in %.1f s, %d graphs compiled",
        shape,
        tokens,
        steps(config) - 1,
        run.seconds,
        run.compiled,
    )
    return run


def warm_message(member: GroupMember, config: DiTConfig, shape: str, tokens: int) -> Message:
    """A t2va request of `shape` with random text embeddings of `tokens` rows, naming the adapter a compiled DiT should
    hold in its slot before serving, through the service's own checks."""
    height, width, frames = parse_shape(shape)
    spec = dit_pb2.DenoiseSpec(
        job_id=f"warmup-{shape}-{tokens}",
        workflow=WORKFLOW.value,
        height=height,
        width=width,
        num_frames=frames,
        params=common_pb2.GenerationParams(num_inference_steps=steps(config), seed=SEED),
    )
    for name in member.runner.adapters.warm(WORKFLOW.partition):  # its factors in a slot before SERVING
        spec.params.adapters.add(name=name, weight=1.0)
    check = checks.DenoiseCheck(
        config,
        [flow.value for flow in served(config.workflows)],
        lambda flow: checks.model_dims(member.runner, flow),
        AdapterCatalog.from_info(dit_pb2.DiTInfo(**member.runner.adapters.describe())),  # as the server checks
    )
    check.expect(spec)
    assert check.dims is not None  # set by expect()
    generator = torch.Generator().manual_seed(SEED)
    text = {
        "prompt_embeds": torch.randn(1, tokens, check.dims.text_dim, generator=generator),
        "text_token_tags": torch.full((tokens,), rules.TEXT_TAG, dtype=torch.int64),
    }
    return Message(WARMUP, spec, text, check.conditioning(spec, text))
