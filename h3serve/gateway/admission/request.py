"""Request validation: a GenerateRequest becomes the exact ResolvedRequest that runs, or InvalidRequest.

The rules are MiniMax-H3's own (diffusers' minimax_h3 modular pipeline), restated here without the model so the
gateway can refuse a bad request before any stage does work. Where diffusers silently rounds a frame count up,
the gateway refuses and says what it would round to: what runs must be exactly what was asked.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from h3serve.v1 import common_pb2, gateway_pb2
from h3serve.common.config import GatewayConfig

FPS = 24
MIN_SECONDS, MAX_SECONDS = 5, 15
# The video VAE encodes chunks of 17 frames keeping 5 latents each: frame counts are 17n+5, latents 5n+2.
FRAMES_PER_CHUNK, LATENTS_PER_CHUNK = 17, 5
CANVAS_MULTIPLE = 32
CANVAS_SHORT_EDGE = 768
CANVAS_MAX_PIXELS = 768 * 1344  # 1,032,192
MAX_ASPECT = 4  # width/height within 1/4..4

VALID_NUM_FRAMES = tuple(
    f for f in range(MIN_SECONDS * FPS, MAX_SECONDS * FPS + 1) if f % FRAMES_PER_CHUNK == LATENTS_PER_CHUNK
)
MAX_SECONDS_EXACT = VALID_NUM_FRAMES[-1] / FPS  # 345 frames = 14.375 s
DEFAULT_NUM_FRAMES = VALID_NUM_FRAMES[0]


class InvalidRequest(ValueError):
    """A request field breaks a rule; `message` starts with the field name and says what is allowed."""

    def __init__(self, field: str, detail: str):
        self.field = field
        self.message = f"{field}: {detail}"
        super().__init__(self.message)


@dataclass(frozen=True)
class RequestLimits:
    max_prompt_chars: int = 8192
    max_steps: int = 200
    default_steps: int = 50

    def __post_init__(self):
        if not 2 <= self.default_steps <= self.max_steps:
            raise ValueError(f"default_steps must be within 2..max_steps ({self.max_steps}), got {self.default_steps}")

    @classmethod
    def from_config(cls, cfg: GatewayConfig) -> RequestLimits:
        return cls(max_prompt_chars=cfg.max_prompt_chars, max_steps=cfg.max_steps, default_steps=cfg.default_steps)


def latent_frames(num_frames: int) -> int:
    """Latent frames of a 17n+5 frame count: 5n+2."""
    n, rest = divmod(num_frames - LATENTS_PER_CHUNK, FRAMES_PER_CHUNK)
    if rest or n < 0:
        raise ValueError(f"num_frames must be 17n+5, got {num_frames}")
    return n * LATENTS_PER_CHUNK + 2


def _align_frames(frames: int) -> int:
    """The next 17n+5 at or above `frames` (diffusers' align_num_frames)."""
    return frames + (LATENTS_PER_CHUNK - frames) % FRAMES_PER_CHUNK


def _aspect_ok(width: float, height: float) -> bool:
    return height <= MAX_ASPECT * width and width <= MAX_ASPECT * height


def canvas_for_aspect(aspect_width: float, aspect_height: float, short_edge: int = CANVAS_SHORT_EDGE,
                      max_pixels: int = CANVAS_MAX_PIXELS) -> tuple[int, int]:
    """(height, width) MiniMax-H3 generates on for an aspect ratio: the short edge at 768, the area capped at the
    pixel budget, both axes rounded to the nearest multiple of 32 (diffusers' resolve_canvas_size)."""
    if aspect_width <= 0 or aspect_height <= 0 or not _aspect_ok(aspect_width, aspect_height):
        raise ValueError(f"aspect ratio must be within 1:{MAX_ASPECT} and {MAX_ASPECT}:1, "
                         f"got {aspect_width}:{aspect_height}")
    ratio = aspect_width / aspect_height
    # Same operations in the same order as diffusers, so float rounding cannot tip a side to another multiple.
    if ratio >= 1:
        height, width = float(short_edge), short_edge * ratio
    else:
        height, width = short_edge / ratio, float(short_edge)
    area = width * height
    if area > max_pixels:
        scale = (max_pixels / area) ** 0.5
        height, width = height * scale, width * scale
    # Python's round (half to even), as diffusers uses.
    return tuple(max(CANVAS_MULTIPLE, round(side / CANVAS_MULTIPLE) * CANVAS_MULTIPLE) for side in (height, width))


DEFAULT_CANVAS = canvas_for_aspect(16, 9)  # (768, 1344)


def _prompt(prompt: str, limits: RequestLimits) -> str:
    if not prompt.strip():
        raise InvalidRequest("prompt", "required and must not be blank")
    if len(prompt) > limits.max_prompt_chars:
        raise InvalidRequest("prompt", f"at most {limits.max_prompt_chars} characters, got {len(prompt)}")
    return prompt  # verbatim: whitespace is part of what the encoder sees


def _workflow(req: gateway_pb2.GenerateRequest) -> int:
    """The requested workflow, or the one its media imply: references -> ref2va, a keyframe -> fl2va."""
    if req.workflow == common_pb2.WORKFLOW_UNSPECIFIED:
        if req.references:
            return common_pb2.WORKFLOW_REF2VA
        return common_pb2.WORKFLOW_FL2VA if req.first_frame or req.last_frame else common_pb2.WORKFLOW_T2VA
    if req.workflow in common_pb2.Workflow.values():
        return req.workflow
    raise InvalidRequest("workflow", f"unknown value {req.workflow}; one of T2VA, FL2VA, REF2VA")


def _canvas(height: int, width: int) -> tuple[int, int]:
    if not height and not width:
        return DEFAULT_CANVAS
    for field, value, other in (("height", height, "width"), ("width", width, "height")):
        if not value:
            raise InvalidRequest(field, f"required when {other} is set: height and width go together "
                                        f"(or leave both 0 for the default {DEFAULT_CANVAS[0]}x{DEFAULT_CANVAS[1]})")
        if value <= 0 or value % CANVAS_MULTIPLE:
            raise InvalidRequest(field, f"must be a positive multiple of {CANVAS_MULTIPLE}, got {value}")
    if not _aspect_ok(width, height):
        longer = "width" if width > height else "height"
        raise InvalidRequest(longer, f"aspect ratio width/height must be within 1:{MAX_ASPECT} and {MAX_ASPECT}:1, "
                                     f"got height {height}, width {width} ({width / height:g})")
    if height * width > CANVAS_MAX_PIXELS:
        raise InvalidRequest("height", f"height*width must be at most {CANVAS_MAX_PIXELS:,} pixels (the model's "
                                       f"canvas budget), got {height}*{width} = {height * width:,}")
    return height, width


def _num_frames(num_frames: int, seconds: float) -> int:
    if num_frames and seconds:
        raise InvalidRequest("num_frames", "give num_frames or seconds, not both")
    if seconds:
        return _frames_for_seconds(seconds)
    if not num_frames:
        return DEFAULT_NUM_FRAMES
    if num_frames not in VALID_NUM_FRAMES:
        above = [f for f in VALID_NUM_FRAMES if f >= num_frames]
        hint = f"{num_frames} rounds up to {above[0]}" if above else f"{num_frames} is above {VALID_NUM_FRAMES[-1]}"
        raise InvalidRequest("num_frames", f"must be 17n+5 between {VALID_NUM_FRAMES[0]} and {VALID_NUM_FRAMES[-1]} "
                                           f"({MIN_SECONDS}-{MAX_SECONDS} s at {FPS} fps): "
                                           f"{', '.join(map(str, VALID_NUM_FRAMES))}; {hint}")
    return num_frames


def _frames_for_seconds(seconds: float) -> int:
    # NaN fails the range comparison too.
    frames = _align_frames(round(seconds * FPS)) if MIN_SECONDS <= seconds <= MAX_SECONDS else None
    if frames is None or frames > VALID_NUM_FRAMES[-1]:
        # The 17n+5 after 345 is 362 = 15.08 s, past the model's limit, so the real ceiling is 14.375 s.
        raise InvalidRequest("seconds", f"must be between {MIN_SECONDS} and {MAX_SECONDS_EXACT:g} "
                                        f"({VALID_NUM_FRAMES[-1]} frames, the longest 17n+5 within {MIN_SECONDS}-"
                                        f"{MAX_SECONDS} s at {FPS} fps), got {seconds:g}")
    return frames


def _steps(steps: int, limits: RequestLimits) -> int:
    if not steps:
        return limits.default_steps
    if not 2 <= steps <= limits.max_steps:
        raise InvalidRequest("num_inference_steps", f"must be between 2 and {limits.max_steps} (sigma grid points: "
                                                    f"N gives N-1 denoise steps, so 1 would denoise nothing), "
                                                    f"got {steps}")
    return steps


def resolve(req: gateway_pb2.GenerateRequest, limits: RequestLimits) -> gateway_pb2.ResolvedRequest:
    """Apply defaults and MiniMax-H3's rules; raise InvalidRequest naming the first field that breaks one."""
    prompt = _prompt(req.prompt, limits)
    workflow = _workflow(req)
    height, width = _canvas(req.height, req.width)
    num_frames = _num_frames(req.num_frames, req.seconds)
    steps = _steps(req.num_inference_steps, limits)
    seed = req.seed if req.HasField("seed") else secrets.randbits(63)
    return gateway_pb2.ResolvedRequest(
        prompt=prompt, height=height, width=width, num_frames=num_frames, num_inference_steps=steps,
        seed=seed, include_raw=req.include_raw, workflow=workflow,
    )
