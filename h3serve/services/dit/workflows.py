"""The DiT's three workflows: which partition each needs, its core denoise blocks, its conditioning inputs.

t2va and fl2va run on the `transformer` partition, ref2va on `transformer_ref`; a service loads only
the partitions of the workflows it is configured for. fl2va and ref2va add conditioning latents from
the VAE service; ref2va also needs a manifest of its references, of which diffusers' layout blocks only
read `kind` and `has_audio`, so stand-in references without media carry it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from diffusers.modular_pipelines.minimax_h3.denoise import (
    MiniMaxH3LoopSchedulerStep,
    MiniMaxH3Ref2VADenoiseStep,
    MiniMaxH3Ref2VALoopDenoiser,
)
from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import (
    MiniMaxH3FL2VACoreDenoiseStep,
    MiniMaxH3Ref2VACoreDenoiseStep,
)

from h3serve.v1 import common_pb2, dit_pb2, media_pb2
from h3serve.services.dit.loop import ObservedDenoiseStep, StepObserverBlock, t2va_core_blocks

WORKFLOWS = {"t2va": common_pb2.WORKFLOW_T2VA, "fl2va": common_pb2.WORKFLOW_FL2VA,
             "ref2va": common_pb2.WORKFLOW_REF2VA}
PARTITIONS = {common_pb2.WORKFLOW_T2VA: "transformer", common_pb2.WORKFLOW_FL2VA: "transformer",
              common_pb2.WORKFLOW_REF2VA: "transformer_ref"}
SCHEDULERS = ["scheduler", "audio_scheduler"]


class ObservedRef2VADenoiseStep(MiniMaxH3Ref2VADenoiseStep):
    block_classes = [MiniMaxH3Ref2VALoopDenoiser, MiniMaxH3LoopSchedulerStep, StepObserverBlock]
    block_names = ["denoiser", "update", "observe"]


def served(names: tuple[str, ...] | list[str]) -> list[int]:
    """Workflow enum values from config names; ValueError names the unknown ones."""
    unknown = [name for name in names if name not in WORKFLOWS]
    if unknown or not names:
        raise ValueError(f"workflows: {unknown or 'none given'}; choose from {', '.join(WORKFLOWS)}")
    return [WORKFLOWS[name] for name in names]


def partitions(workflows: list[int]) -> list[str]:
    """The transformer partitions `workflows` need, in a fixed order."""
    needed = {PARTITIONS[w] for w in workflows}
    return [name for name in ("transformer", "transformer_ref") if name in needed]


def core_blocks(workflow: int):
    """The workflow's core denoise blocks with the observed loop in place of diffusers' loop."""
    if workflow == common_pb2.WORKFLOW_T2VA:
        return t2va_core_blocks()
    if workflow == common_pb2.WORKFLOW_FL2VA:
        core = MiniMaxH3FL2VACoreDenoiseStep()
        core.sub_blocks["denoise"] = ObservedDenoiseStep()
        return core
    core = MiniMaxH3Ref2VACoreDenoiseStep()
    core.sub_blocks["denoise"] = ObservedRef2VADenoiseStep()
    return core


def stand_in(entry: media_pb2.ReferenceEntry):
    """A reference without media: what the ref2va layout reads of it is its kind and whether it has audio."""
    from diffusers.modular_pipelines.minimax_h3 import (
        MiniMaxH3AudioReference,
        MiniMaxH3ImageReference,
        MiniMaxH3VideoReference,
    )

    if entry.kind == media_pb2.ASSET_KIND_IMAGE:
        return MiniMaxH3ImageReference(image=None)
    if entry.kind == media_pb2.ASSET_KIND_VIDEO:
        return MiniMaxH3VideoReference(frames=None, audio=torch.empty(0) if entry.has_audio else None)
    return MiniMaxH3AudioReference(audio=torch.empty(0))


def tensor_names(spec: dit_pb2.DenoiseSpec) -> tuple[str, ...]:
    """Every tensor a Denoise request of `spec` must carry."""
    if spec.workflow == common_pb2.WORKFLOW_FL2VA:
        visual, audio = len(spec.keyframe_anchors), 0
    else:
        visual = sum(r.kind != media_pb2.ASSET_KIND_AUDIO for r in spec.references)
        audio = sum(r.has_audio for r in spec.references)
    return ("prompt_embeds", "text_token_tags", *(f"condition_latents.{i}" for i in range(visual)),
            *(f"audio_condition_latents.{j}" for j in range(audio)))


@dataclass
class Conditioning:
    """The workflow-specific inputs of one denoise request; empty for t2va."""

    inputs: dict = field(default_factory=dict)

    @classmethod
    def from_spec(cls, spec: dit_pb2.DenoiseSpec, tensors: dict[str, torch.Tensor]) -> Conditioning:
        if spec.workflow == common_pb2.WORKFLOW_FL2VA:
            if not spec.keyframe_anchors or set(spec.keyframe_anchors) - {"first", "last"}:
                raise ValueError(f"keyframe_anchors: fl2va needs 'first' and/or 'last', "
                                 f"got {list(spec.keyframe_anchors)}")
            return cls({"keyframe_anchors": tuple(spec.keyframe_anchors),
                        "condition_latents": _numbered(tensors, "condition_latents")})
        if spec.workflow == common_pb2.WORKFLOW_REF2VA:
            if not spec.references:
                raise ValueError("references: ref2va needs at least one reference")
            return cls({"normalized_references": [stand_in(entry) for entry in spec.references],
                        "condition_latents": _numbered(tensors, "condition_latents"),
                        "audio_condition_latents": _numbered(tensors, "audio_condition_latents")})
        if spec.keyframe_anchors or spec.references:
            raise ValueError("t2va takes no keyframe_anchors or references")
        return cls()


def _numbered(tensors: dict[str, torch.Tensor], prefix: str) -> list[torch.Tensor]:
    names = sorted((name for name in tensors if name.startswith(prefix + ".")), key=lambda n: int(n.rsplit(".", 1)[1]))
    return [tensors[name] for name in names]
