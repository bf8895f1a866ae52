"""Every check of the sharded DiT that needs ranks, in one launch of 2 ranks (tests/test_distributed.py forks them
from its fork server with torchrun's environment; from the checkout's root, torchrun runs them as well):

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.dist_checks OUT.json

Each variant builds the tiny transformer afresh (same seed, same weights), prepares it exactly
as the service does (`prepare_transformer`) and runs a request through the service's own group
member: rank 0 broadcasts the job on the control group, every rank runs it. Rank 0 compares
the latents with the one-rank runner in the same process and writes what it saw to OUT.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from h3serve.common.config import DiTConfig
from h3serve.model import workflows
from h3serve.runtime import compile_cache
from h3serve.runtime.fastpath import FastPath
from h3serve.runtime.kernels import local as local_kernels
from h3serve.runtime.tiny import build_component
from h3serve.services.dit import adapters, parallel
from h3serve.services.dit.group import JOB, ControlPlane, GroupMember, Message
from h3serve.services.dit.runner import DenoiseRunner
from h3serve.v1 import common_pb2, dit_pb2, media_pb2

CPU = torch.device("cpu")
T2VA = workflows.by_value(common_pb2.WORKFLOW_T2VA)
JOB_SPEC = dit_pb2.DenoiseSpec(
    height=32,
    width=64,
    num_frames=124,
    workflow=common_pb2.WORKFLOW_T2VA,
    params=common_pb2.GenerationParams(num_inference_steps=5, seed=3),
)
# packed length = text + 414 audio rows + 74 video rows: 10 tokens give an even length, 11 an odd one
TEXT_TOKENS = (10, 11)
VARIANTS = [
    parallel.Layout(2, 2, 1, False),
    parallel.Layout(2, 1, 2, False),
    parallel.Layout(2, 2, 1, True),
    parallel.Layout(2, 1, 2, True),
]


def components(dtype: torch.dtype = torch.float32, partition: str = "transformer") -> dict:
    """The tiny preset; in bf16 its fp32-pinned modules stay fp32, as a released checkpoint loads."""
    from diffusers.schedulers import MiniMaxH3Scheduler

    transformer = build_component(partition)
    if dtype != torch.float32:
        transformer.to(dtype)
        for name in transformer._keep_in_fp32_modules:
            getattr(transformer, name).float()
    return {
        partition: transformer,
        "scheduler": MiniMaxH3Scheduler(shift=12.0),
        "audio_scheduler": MiniMaxH3Scheduler(shift=3.0),
    }


def inputs(tokens: int) -> dict[str, torch.Tensor]:
    embeds = torch.randn(1, tokens, 32, generator=torch.Generator().manual_seed(tokens))
    return {"prompt_embeds": embeds, "text_token_tags": torch.ones(tokens, dtype=torch.int64)}


def member_for(
    control: ControlPlane,
    layout: parallel.Layout,
    dtype: torch.dtype = torch.float32,
    workflow: int = common_pb2.WORKFLOW_T2VA,
    fast: FastPath = FastPath("native"),
) -> GroupMember:
    flow = workflows.by_value(workflow)
    parts = components(dtype, flow.partition)
    parallel.prepare_transformer(parts[flow.partition], layout, fast, CPU, dtype)
    return GroupMember(control, DenoiseRunner(parts, [flow]), CPU, "native", max_math_tokens=4096)


def cpu_kernel(q, k, v, softmax_scale=None, causal=False):
    """A stand-in for FlashAttention 4 / cuDNN FP8 in their slot: (batch, rows, heads, dim) attention on the CPU."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=softmax_scale, is_causal=causal
    )
    return out.transpose(1, 2)


def slot_member(control: ControlPlane, layout: parallel.Layout) -> GroupMember:
    """The local-kernel slot (h3serve/runtime/kernels/local.py) under `layout`, with the CPU kernel in it."""
    parts = components()
    local_kernels.install(cpu_kernel)
    local_kernels.use(parts["transformer"])
    parallel.parallelize(parts["transformer"], layout, CPU)
    return GroupMember(control, DenoiseRunner(parts, [T2VA]), CPU, "native", max_math_tokens=4096)


def conditioned(workflow: int) -> tuple[dit_pb2.DenoiseSpec, dict]:
    """An fl2va (first keyframe) or ref2va (one image reference) request with random conditioning latents."""
    spec = dit_pb2.DenoiseSpec()
    spec.CopyFrom(JOB_SPEC)
    spec.workflow = workflow
    if workflow == common_pb2.WORKFLOW_FL2VA:
        spec.keyframe_anchors.append("first")
    else:
        spec.references.add(kind=media_pb2.ASSET_KIND_IMAGE)
    latents = {"condition_latents.0": torch.randn(1, 24, 1, 2, 4, generator=torch.Generator().manual_seed(workflow))}
    return spec, workflows.by_value(workflow).denoise_inputs(spec, latents)


def run(member: GroupMember, message: Message | None, stop_at: int = 0):
    """Rank 0 sends `message`; every rank runs it; rank 0 asks to stop after step `stop_at` (0: never)."""
    message = member.control.broadcast(message)
    seen = []
    return member.run(
        message,
        lambda step, total: seen.append(step),
        lambda: bool(stop_at) and seen[-1] >= stop_at and member.control.rank == 0,
    )


def one_rank(
    control: ControlPlane,
    job: dit_pb2.DenoiseSpec,
    tokens: int,
    conditioning: dict | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict | None:
    """The one-rank runner's latents for `job`, on rank 0 only: rank 0 compares and reports, and a reference computed
    on rank 1 as well only took the CPU that rank 0's share of the group needed."""
    if control.rank != 0:
        return None
    flow = workflows.by_value(job.workflow)
    runner = DenoiseRunner(components(dtype, flow.partition), [flow])
    return runner.run(job, *inputs(tokens).values(), lambda s, t: None, conditioning)


def max_diff(a: dict, b: dict | None) -> float | None:
    """The largest difference of the video and audio latents; None on a rank without the reference (it reports none)."""
    if b is None:
        return None
    return max((a[k] - b[k]).abs().max().item() for k in ("latents", "audio_latents"))


def applied(member: GroupMember) -> dict:
    transformer = member.runner.pipes[common_pb2.WORKFLOW_T2VA].transformer
    sharded = all(isinstance(p, DTensor) for p in transformer.transformer_blocks.parameters())
    split = any(
        getattr(m.processor, "_parallel_config", None) is not None
        for m in transformer.modules()
        if hasattr(m, "processor")
    )
    return {"fsdp": sharded, "context_parallel": split}


def adapter_member(control: ControlPlane, layout: parallel.Layout, config: DiTConfig) -> GroupMember:
    """The tiny transformer with `config`'s adapters installed as rank.py installs them, then prepared for `layout`."""
    parts = components()
    held = adapters.install(config, {"transformer": parts["transformer"]})
    parallel.prepare_transformer(parts["transformer"], layout, FastPath("native"), CPU, torch.float32)
    return GroupMember(control, DenoiseRunner(parts, [T2VA], held), CPU, "native", max_math_tokens=4096)


def adapter_checks(control: ControlPlane, root: Path) -> dict:
    """Adapters switched per request on 2 ranks with FSDP2 (peft's own switch, and the compiled path's slots, whose
    sharded factors are written in place) against one rank."""
    # here, not at the top: tests/test_sharded_load.py's ranks import this module from tests/ as `dist_checks`
    from tests.lora_files import diffusers_lora, original_lora

    root.mkdir(parents=True, exist_ok=True)
    loras = {
        "a": str(original_lora(root / "a.safetensors", 1, 4, 2.0)),
        "b": str(diffusers_lora(root / "b", 2, 2, 4.0)),
    }
    requests = [[("a", 1.0)], [("b", 1.0)], [("a", 0.5)], []]
    jobs = []
    for named in requests:
        job = dit_pb2.DenoiseSpec()
        job.CopyFrom(JOB_SPEC)
        job.params.num_inference_steps = 3
        job.params.adapters.extend(common_pb2.Adapter(name=name, weight=weight) for name, weight in named)
        jobs.append(job)
    report = {}
    for mode, config in (("resident", DiTConfig(adapters=loras)), ("slots", DiTConfig(adapters=loras, compile=True))):
        parts = components()
        reference = None  # rank 0's one-rank runner (one_rank's reason)
        if control.rank == 0:
            reference = DenoiseRunner(parts, [T2VA], adapters.install(config, {"transformer": parts["transformer"]}))
        member = adapter_member(control, VARIANTS[2], config)
        lora = [p for n, p in member.runner.pipes[T2VA.value].transformer.named_parameters() if ".lora_" in n]
        report[f"{mode} sharded"] = bool(lora) and all(isinstance(p, DTensor) for p in lora)
        for job, named in zip(jobs, requests, strict=True):
            message = Message(JOB, job, inputs(11)) if control.rank == 0 else None
            expected = reference and reference.run(job, *inputs(11).values(), lambda s, t: None)
            report[f"{mode} {named}"] = max_diff(run(member, message).latents, expected)
    return report


def main(out_path: str) -> None:
    control = ControlPlane(parallel.init_groups(CPU, timeout_s=120))
    report = {"latents": {}, "applied": {}}
    for tokens in TEXT_TOKENS:
        message = Message(JOB, JOB_SPEC, inputs(tokens)) if control.rank == 0 else None
        reference = one_rank(control, JOB_SPEC, tokens)
        for layout in VARIANTS:
            member = member_for(control, layout)
            outcome = run(member, message)
            name = f"{layout.split} fsdp={layout.fsdp} S={tokens + 488}"
            report["latents"][name] = max_diff(outcome.latents, reference)
            report["applied"][name] = applied(member)

    report["workflows"] = {}
    for workflow in (common_pb2.WORKFLOW_FL2VA, common_pb2.WORKFLOW_REF2VA):
        job, conditioning = conditioned(workflow)
        reference = one_rank(control, job, 11, conditioning)
        for layout in VARIANTS[:2]:
            message = Message(JOB, job, inputs(11), conditioning) if control.rank == 0 else None
            outcome = run(member_for(control, layout, workflow=workflow), message)
            name = f"{common_pb2.Workflow.Name(workflow)} {layout.split}"
            report["workflows"][name] = max_diff(outcome.latents, reference)

    message = Message(JOB, JOB_SPEC, inputs(11)) if control.rank == 0 else None
    reference = one_rank(control, JOB_SPEC, 11)
    report["local_kernel_slot"] = {
        layout.split + f" fsdp={layout.fsdp}": max_diff(run(slot_member(control, layout), message).latents, reference)
        for layout in (VARIANTS[0], VARIANTS[2])
    }

    # the deployment files' setting: regional compile with the sequence split, prompts of both length parities
    compiled = member_for(control, VARIANTS[0], fast=FastPath("native", compile=True))
    report["compiled_ulysses"], report["compiled_graphs"] = 0.0, []
    for tokens in (10, 11, 10, 13, 12, 14, 11):  # packed length residues mod 4: 2, 3, 2, 1, 0, 2, 3
        graphs = compile_cache.compiled_graphs()
        outcome = run(compiled, Message(JOB, JOB_SPEC, inputs(tokens)) if control.rank == 0 else None)
        report["compiled_graphs"].append(compile_cache.compiled_graphs() - graphs)
        if control.rank == 0:
            diff = max_diff(outcome.latents, one_rank(control, JOB_SPEC, tokens))
            report["compiled_ulysses"] = max(report["compiled_ulysses"], diff)

    # production dtypes: bf16 blocks next to fp32-pinned projections, sharded by FSDP2
    message = Message(JOB, JOB_SPEC, inputs(10)) if control.rank == 0 else None
    mixed = run(member_for(control, VARIANTS[2], torch.bfloat16), message)
    reference = one_rank(control, JOB_SPEC, 10, dtype=torch.bfloat16)
    report["mixed_dtype_fsdp"] = max_diff(mixed.latents, reference)

    report["adapters"] = adapter_checks(control, Path(out_path).parent / f"loras-{control.rank}")

    member = member_for(control, VARIANTS[0])
    cancelled = run(member, message, stop_at=2)
    after = run(member, message)
    report["cancel"] = {
        "cancelled": cancelled.cancelled,
        "steps": [r.steps_served for r in cancelled.ranks],
        "next_matches": max_diff(after.latents, one_rank(control, JOB_SPEC, 10)),
        "steps_after": [r.steps_served for r in after.ranks],
    }
    if control.rank == 0:
        with open(out_path, "w") as out:
            json.dump(report, out, indent=1)
    dist.barrier()  # without it gloo teardown sometimes aborts
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
