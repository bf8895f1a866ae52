"""What rank 0 checks of a Denoise request before the group sees it: a request that reaches the ranks is one the
model runs, so a bad one is INVALID_ARGUMENT here and never breaks the group.

The spec is checked as it arrives, before any tensor byte is read: the id, a served workflow, the canvas and the
frame count the gateway resolves, the steps within `max_steps`, the workflow's manifest, the packed rows of
the generated video within `max_rows`, and the adapters and shifts (h3serve/model/adapters.py: loaded here,
targeting the workflow's partition, within bounds). The rows left for the text and the conditioning bound the
bytes the tensors may take. Once they arrived: their dtypes, the text's shape against the model's text width and its row
tags, the conditioning latents against the manifest (the workflow's rules), and the whole packed sequence.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from h3serve.common.bounds import check_id
from h3serve.common.config import DiTConfig
from h3serve.model import adapters, rules, workflows
from h3serve.model.adapters import AdapterCatalog
from h3serve.model.rules import InvalidRequest
from h3serve.model.workflows.base import ModelDims, Workflow, check_shape
from h3serve.runtime import wire
from h3serve.runtime.checks import check_dtype
from h3serve.services.dit import attention
from h3serve.v1 import dit_pb2

EMBED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the text encoder's compute dtypes
FLOAT32_BYTES, INT64_BYTES = 4, 8


def served_workflow(spec: dit_pb2.DenoiseSpec, served: list[int]) -> Workflow:
    """The spec's workflow when this DiT serves it; ValueError names what it serves."""
    workflow = workflows.by_value(spec.workflow)
    if workflow.value not in served:
        names = ", ".join(workflows.by_value(value).name for value in served)
        raise ValueError(f"workflow: {workflow.name} is not served by this DiT (serves {names})")
    return workflow


def model_dims(runner, workflow: Workflow) -> ModelDims:
    """The widths of the transformer partition that runs `workflow` (runner: services/dit/runner.DenoiseRunner)."""
    config = runner.pipes[workflow.value].components[workflow.partition].config
    return ModelDims(config.text_dim, config.in_channels, config.audio_in_channels)


def row_bytes(dims: ModelDims) -> int:
    """The most input bytes one packed row can take: a text row (its embedding in float32 and its int64 tag), a
    2x2 patch of conditioning latents or a row of a soundtrack's latents."""
    return max(
        FLOAT32_BYTES * dims.text_dim + INT64_BYTES,
        FLOAT32_BYTES * rules.PATCH**2 * dims.latent_channels,
        FLOAT32_BYTES * dims.audio_latent_channels,
    )


class DenoiseCheck:
    """One Denoise request's checks: `expect` when its spec arrives, `conditioning` once its tensors have.
    `dims_of(workflow)` gives the served model's widths (it raises when the group cannot run anything now);
    `catalog` the adapters the group loaded."""

    def __init__(
        self,
        config: DiTConfig,
        served: list[int],
        dims_of: Callable[[Workflow], ModelDims],
        catalog: AdapterCatalog = AdapterCatalog(),
    ) -> None:
        self.config, self.served, self.dims_of, self.catalog = config, served, dims_of, catalog
        self.workflow: Workflow | None = None
        self.dims: ModelDims | None = None

    def expect(self, spec: dit_pb2.DenoiseSpec) -> wire.Expected:
        check_id("job_id", spec.job_id)
        self.workflow = served_workflow(spec, self.served)
        rules.check_resolved_canvas(spec.height, spec.width, self.config.geometry)
        rules.check_num_frames(spec.num_frames)
        rules.check_steps(spec.params.num_inference_steps, self.config.max_steps)
        self.workflow.check_manifest(spec)
        generated = rules.generated_rows(spec.height, spec.width, spec.num_frames).total
        if generated >= self.config.max_rows:
            raise InvalidRequest(
                "num_frames",
                f"{spec.height}x{spec.width} at {spec.num_frames} frames is "
                f"{generated} packed rows, over max_rows {self.config.max_rows}",
            )
        self.dims = self.dims_of(self.workflow)
        adapters.check(spec.params, self.workflow, self.catalog)
        budget = (self.config.max_rows - generated) * row_bytes(self.dims)
        return wire.Expected(self.workflow.tensor_names(spec), min(self.config.max_input_bytes, budget))

    def conditioning(self, spec: dit_pb2.DenoiseSpec, tensors: dict[str, torch.Tensor]) -> dict:
        """The workflow's denoise inputs of tensors that passed every check."""
        workflow, dims = self.workflow, self.dims
        assert workflow is not None and dims is not None  # expect() set them, for the spec these tensors follow
        embeds, tags = tensors["prompt_embeds"], tensors["text_token_tags"]
        check_dtype("prompt_embeds", embeds, *EMBED_DTYPES)
        check_shape("prompt_embeds", tuple(embeds.shape), (1, None, dims.text_dim))
        check_dtype("text_token_tags", tags, torch.int64)
        check_shape("text_token_tags", tuple(tags.shape), (embeds.shape[1],))
        if not torch.isin(tags, torch.tensor(rules.TEXT_ROW_TAGS)).all():
            raise InvalidRequest(
                "text_token_tags",
                f"a text row is tagged {rules.TEXT_TAG} (text) or "
                f"{rules.VIDEO_TAG} (a vision block's row), got "
                f"{sorted(set(tags.unique().tolist()))[:8]}",
            )
        conditions = {name: tensors[name] for name in workflow.tensor_names(spec)[2:]}
        for name, tensor in conditions.items():
            check_dtype(name, tensor, torch.float32)
        workflow.check_conditioning(
            spec, {name: tuple(t.shape) for name, t in conditions.items()}, dims, self.config.geometry
        )
        inputs = workflow.denoise_inputs(spec, tensors)
        rows = attention.packed_length(embeds.shape[1], spec, inputs)
        if rows > self.config.max_rows:
            raise InvalidRequest(
                "prompt_embeds", f"the packed sequence is {rows} rows, over max_rows {self.config.max_rows}"
            )
        return inputs
