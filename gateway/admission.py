"""Admission by capacity: the DiT's packed sequence must fit what this deployment was measured to hold.

Peak DiT memory grows with the packed-sequence length (field notes: ~11.2 GB + 6.2e-4 GB/row on one
card), so the deployment states, per workflow and canvas, the most rows its DiT replicas take. A request
over that is refused at submit with the frame ceiling that does fit, instead of failing after minutes
in the queue. `packed_rows` is the one place that counts rows; conditioning workflows pass their extra
rows (keyframes, references) through `condition_rows`.
"""

from __future__ import annotations

from dataclasses import dataclass

from h3serve.v1 import common_pb2, gateway_pb2
from gateway.request import FPS, InvalidRequest, VALID_NUM_FRAMES, latent_frames

PIXELS_PER_ROW_EDGE = 32       # VAE 16x spatial compression x transformer patch 2 on each axis
AUDIO_LATENTS_PER_SECOND = 40  # audio VAE hop 800 at 32 kHz
AUDIO_CHANNELS = 2             # stereo runs as a batch of two mono rows
ANY_CANVAS = "*"


@dataclass(frozen=True)
class Rows:
    """Rows of one request's packed DiT sequence, by kind."""

    text: int
    audio: int
    video: int
    condition: int = 0

    @property
    def total(self) -> int:
        return self.text + self.audio + self.video + self.condition


def rows_per_latent_frame(height: int, width: int) -> int:
    return (height // PIXELS_PER_ROW_EDGE) * (width // PIXELS_PER_ROW_EDGE)


def audio_latents(num_frames: int) -> int:
    """round(F/24 * 40): 124 -> 207, 345 -> 575 (diffusers' audio length for a frame count)."""
    return round(num_frames / FPS * AUDIO_LATENTS_PER_SECOND)


def text_rows_bound(prompt: str) -> int:
    """An upper bound on the prompt's token rows known before encoding: a byte-level BPE tokenizer (Qwen's)
    emits at most one token per UTF-8 byte."""
    return len(prompt.encode("utf-8"))


def packed_rows(height: int, width: int, num_frames: int, text_rows: int, condition_rows: int = 0) -> Rows:
    """Rows of the packed sequence: text, 2 x audio latents, latent frames x rows per frame, conditioning."""
    return Rows(text=text_rows, audio=AUDIO_CHANNELS * audio_latents(num_frames),
                video=latent_frames(num_frames) * rows_per_latent_frame(height, width), condition=condition_rows)


def canvas_key(height: int, width: int) -> str:
    return f"{height}x{width}"


@dataclass(frozen=True)
class CapacityTable:
    """{workflow name ("t2va"): {"HxW" or "*": max rows}} from the deployment file."""

    limits: dict

    def __post_init__(self):
        known = {workflow_name(value) for value in common_pb2.Workflow.values() if value}
        for workflow, canvases in self.limits.items():
            if workflow not in known:
                raise ValueError(f"capacity: unknown workflow {workflow!r}; known: {', '.join(sorted(known))}")
            for canvas, limit in canvases.items():
                sides = canvas.split("x")
                if canvas != ANY_CANVAS and not (len(sides) == 2 and all(side.isdigit() for side in sides)):
                    raise ValueError(f"capacity.{workflow}: canvas keys are \"HxW\" or \"*\", got {canvas!r}")
                if not isinstance(limit, int) or limit <= 0:
                    raise ValueError(f"capacity.{workflow}.{canvas}: rows must be a positive integer, got {limit!r}")

    def limit(self, workflow: int, height: int, width: int) -> int | None:
        canvases = self.limits.get(workflow_name(workflow), {})
        return canvases.get(canvas_key(height, width), canvases.get(ANY_CANVAS))

    def max_frames(self, limit: int, height: int, width: int, text_rows: int, condition_rows: int = 0) -> int | None:
        """The longest valid frame count whose rows fit `limit`; None when even the shortest does not."""
        fitting = [f for f in VALID_NUM_FRAMES
                   if packed_rows(height, width, f, text_rows, condition_rows).total <= limit]
        return fitting[-1] if fitting else None

    def admit(self, request: gateway_pb2.ResolvedRequest, condition_rows: int = 0) -> Rows:
        """The request's rows; InvalidRequest("num_frames", ...) naming the ceiling when they do not fit."""
        text = text_rows_bound(request.prompt)
        rows = packed_rows(request.height, request.width, request.num_frames, text, condition_rows)
        limit = self.limit(request.workflow, request.height, request.width)
        if limit is None or rows.total <= limit:
            return rows
        canvas = canvas_key(request.height, request.width)
        ceiling = self.max_frames(limit, request.height, request.width, text, condition_rows)
        allowed = (f"{canvas} allows at most {ceiling} frames here" if ceiling else
                   f"{canvas} allows no video here, not even {VALID_NUM_FRAMES[0]} frames")
        raise InvalidRequest("num_frames", f"{allowed}: {request.num_frames} frames need {rows.total:,} packed rows "
                                           f"(text <= {rows.text}, audio {rows.audio}, video {rows.video}, "
                                           f"conditioning {rows.condition}), this deployment's "
                                           f"{workflow_name(request.workflow)} capacity at {canvas} is {limit:,}")

    def table(self, text_rows: int) -> list[tuple[str, str, int, int | None]]:
        """(workflow, canvas, max rows, max frames for a prompt of `text_rows` rows) for every configured entry."""
        out = []
        for workflow, canvases in sorted(self.limits.items()):
            for canvas, limit in sorted(canvases.items()):
                frames = None
                if canvas != ANY_CANVAS:
                    height, width = (int(side) for side in canvas.split("x"))
                    frames = self.max_frames(limit, height, width, text_rows)
                out.append((workflow, canvas, limit, frames))
        return out


def workflow_name(workflow: int) -> str:
    return common_pb2.Workflow.Name(workflow).removeprefix("WORKFLOW_").lower()
