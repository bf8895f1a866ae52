"""Request resolution: a GenerateRequest becomes the exact ResolvedRequest that runs, or InvalidRequest.

The model's rules come from h3serve/model (rules.py, the workflow registry); this module applies them
with the deployment's limits and defaults, field by field, so a refusal names the first field that
breaks one. Where diffusers silently rounds a frame count up, the gateway refuses and says what it would
round to: what runs is exactly what was asked. The request options (GenerationParams) are resolved here
once and then travel unchanged to the stages.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

from h3serve.common.config import DEFAULT_STEPS, MAX_PROMPT_CHARS, MAX_STEPS, GatewayConfig
from h3serve.model import adapters, options, rules, workflows
from h3serve.model.adapters import AdapterCatalog
from h3serve.model.rules import VALID_NUM_FRAMES, Geometry, InvalidRequest
from h3serve.model.workflows.base import AssetLookup, Workflow
from h3serve.v1 import common_pb2, gateway_pb2

_LABEL = re.compile(r"<(Picture|Video|Audio) (\d+)>")


@dataclass(frozen=True)
class RequestLimits:
    max_prompt_chars: int = MAX_PROMPT_CHARS
    max_steps: int = MAX_STEPS
    default_steps: int = DEFAULT_STEPS
    geometry: Geometry = Geometry()

    def __post_init__(self):
        if not rules.MIN_STEPS <= self.default_steps <= self.max_steps:
            raise ValueError(
                f"default_steps must be within {rules.MIN_STEPS}..max_steps ({self.max_steps}), "
                f"got {self.default_steps}"
            )

    @classmethod
    def from_config(cls, cfg: GatewayConfig) -> RequestLimits:
        return cls(cfg.max_prompt_chars, cfg.max_steps, cfg.default_steps, cfg.geometry)


def _no_assets(asset_id: str) -> None:
    return None


def resolve(
    req: gateway_pb2.GenerateRequest,
    limits: RequestLimits,
    assets: AssetLookup = _no_assets,
    catalog: AdapterCatalog = AdapterCatalog(),
) -> gateway_pb2.ResolvedRequest:
    """Apply defaults and MiniMax-H3's rules; raise InvalidRequest naming the first field that breaks one.
    `catalog`: the adapters the DiT loaded (its Info), which the request's adapters must name."""
    _check_prompt(req.prompt, limits)
    workflow = workflows.of_request(req)
    height, width = _canvas(req.height, req.width, limits.geometry)
    params = _params(req, limits, workflow, catalog)
    resolved = gateway_pb2.ResolvedRequest(
        prompt=req.prompt,
        height=height,
        width=width,
        num_frames=_num_frames(req.num_frames, req.seconds),
        workflow=workflow.value,
        params=params,
    )
    options.write_legacy(resolved)
    workflow.resolve_media(req, resolved, assets, limits.geometry)
    _check_labels(resolved.prompt, workflow.label_counts(resolved))
    resolved.condition_rows = workflow.condition_rows(resolved, assets, limits.geometry).condition
    return resolved


def check_fields(req: gateway_pb2.GenerateRequest, limits: RequestLimits) -> None:
    """`resolve`'s checks that need neither the request's assets nor the DiT's adapters, in its order: what a client
    refuses before sending (`h3serve generate`). InvalidRequest names the field and the limit."""
    _check_prompt(req.prompt, limits)
    workflow = workflows.of_request(req)
    _canvas(req.height, req.width, limits.geometry)
    params = options.folded(req)
    del params.adapters[:]  # the shifts as adapters.check checks them; the adapters need the DiT's catalog
    adapters.check(params, workflow, AdapterCatalog())
    if params.num_inference_steps:  # unset: an adapter's or the deployment's default, both within bounds
        rules.check_steps(params.num_inference_steps, limits.max_steps)
    _num_frames(req.num_frames, req.seconds)


def _check_prompt(prompt: str, limits: RequestLimits) -> None:
    problem = rules.prompt_problem(prompt, limits.max_prompt_chars)
    if problem:
        raise InvalidRequest("prompt", problem)


def _canvas(height: int, width: int, geometry: Geometry) -> tuple[int, int]:
    if not height and not width:
        return geometry.default_canvas
    default = "x".join(map(str, geometry.default_canvas))
    for field, value, other in (("height", height, "width"), ("width", width, "height")):
        if not value:
            raise InvalidRequest(
                field,
                f"required when {other} is set: height and width go together "
                f"(or leave both 0 for the default {default})",
            )
        if value <= 0 or value % rules.CANVAS_MULTIPLE:
            raise InvalidRequest(field, f"must be a positive multiple of {rules.CANVAS_MULTIPLE}, got {value}")
    if not rules.aspect_ok(width, height):
        longer = "width" if width > height else "height"
        raise InvalidRequest(
            longer,
            f"aspect ratio width/height must be within 1:{rules.MAX_ASPECT} and "
            f"{rules.MAX_ASPECT}:1, got height {height}, width {width} ({width / height:g})",
        )
    if height * width > geometry.canvas_max_pixels:
        raise InvalidRequest(
            "height",
            f"height*width must be at most {geometry.canvas_max_pixels:,} pixels (the "
            f"model's canvas budget), got {height}*{width} = {height * width:,}",
        )
    return height, width


def _num_frames(num_frames: int, seconds: float) -> int:
    if num_frames and seconds:
        raise InvalidRequest("num_frames", "give num_frames or seconds, not both")
    if seconds:
        frames = rules.frames_for_seconds(seconds)
        if frames is None:
            raise InvalidRequest(
                "seconds",
                f"must be between {rules.MIN_SECONDS} and {rules.MAX_SECONDS_EXACT:g} "
                f"({VALID_NUM_FRAMES[-1]} frames, the longest 17n+5 within "
                f"{rules.MIN_SECONDS}-{rules.MAX_SECONDS} s at {rules.FPS} fps), "
                f"got {seconds:g}",
            )
        return frames
    if not num_frames:
        return rules.DEFAULT_NUM_FRAMES
    if num_frames not in VALID_NUM_FRAMES:
        above = [f for f in VALID_NUM_FRAMES if f >= num_frames]
        hint = f"{num_frames} rounds up to {above[0]}" if above else f"{num_frames} is above {VALID_NUM_FRAMES[-1]}"
        raise InvalidRequest(
            "num_frames",
            f"must be 17n+5 between {VALID_NUM_FRAMES[0]} and {VALID_NUM_FRAMES[-1]} "
            f"({rules.MIN_SECONDS}-{rules.MAX_SECONDS} s at {rules.FPS} fps): "
            f"{', '.join(map(str, VALID_NUM_FRAMES))}; {hint}",
        )
    return num_frames


def _params(
    req: gateway_pb2.GenerateRequest, limits: RequestLimits, workflow: Workflow, catalog: AdapterCatalog
) -> common_pb2.GenerationParams:
    """The request's options with the deprecated top-level fields folded in, every default applied: the adapters'
    weights, and the steps and shifts their sidecars recommend when the request leaves them unset."""
    params = options.folded(req)
    adapters.check(params, workflow, catalog)
    adapters.resolve(params, catalog, limits.default_steps)
    rules.check_steps(params.num_inference_steps, limits.max_steps)
    if not params.HasField("seed"):
        params.seed = secrets.randbits(63)
    return params


def _check_labels(prompt: str, available: dict[str, int]) -> None:
    """Every <Picture i> / <Video k> / <Audio j> the prompt names must be a keyframe or reference of the request."""
    for kind, number in _LABEL.findall(prompt):
        count = available.get(kind, 0)
        if not 1 <= int(number) <= count:
            raise InvalidRequest(
                "prompt",
                f"names <{kind} {number}>, but the request has {count} {kind.lower()}(s) "
                f"to refer to (numbered per kind from 1, in request order)",
            )
