"""Admission by capacity: the DiT's packed sequence must fit what this deployment was measured to hold.

Peak DiT memory grows with the packed-sequence length (field notes: ~11.2 GB + 6.2e-4 GB/row on one
card), so the deployment states, per workflow and canvas, the most rows its DiT replicas take. A request
over that is refused at submit with the frame ceiling that does fit, instead of failing after minutes
in the queue. The rows are counted by the request's workflow (h3serve/model/workflows: text rows
with the deployment's tokenizer, conditioning rows) and the model's rules (the generated video and audio).
Besides the table, `max_rows` bounds every request.

Every refusal is `OverCapacity`, answered INVALID_ARGUMENT: the same request is refused again by this
deployment, so a client must change it (the message gives the frame ceiling) rather than retry it.
"""

from __future__ import annotations

from dataclasses import dataclass

from h3serve.model import rules, workflows
from h3serve.model.rules import VALID_NUM_FRAMES, InvalidRequest, Rows
from h3serve.v1 import gateway_pb2

ANY_CANVAS = "*"


class OverCapacity(InvalidRequest):
    """The request is valid but needs more DiT rows than the deployment admits."""


def packed_rows(height: int, width: int, num_frames: int, text_rows: int, condition_rows: int = 0) -> Rows:
    """Rows of the packed sequence: text, conditioning (counted as video), and the generated video and audio."""
    generated = rules.generated_rows(height, width, num_frames)
    return Rows(text=text_rows, condition_video=condition_rows, video=generated.video, audio=generated.audio)


def canvas_key(height: int, width: int) -> str:
    return f"{height}x{width}"


@dataclass(frozen=True)
class CapacityTable:
    """{workflow name ("t2va"): {"HxW" or "*": max rows}} from the deployment file, and `max_rows` for any request."""

    limits: dict
    max_rows: int | None = None

    def __post_init__(self):
        for workflow, canvases in self.limits.items():
            if workflow not in workflows.names():
                raise ValueError(f"capacity: unknown workflow {workflow!r}; known: {', '.join(workflows.names())}")
            for canvas, limit in canvases.items():
                sides = canvas.split("x")
                if canvas != ANY_CANVAS and not (len(sides) == 2 and all(side.isdigit() for side in sides)):
                    raise ValueError(f'capacity.{workflow}: canvas keys are "HxW" or "*", got {canvas!r}')
                if not isinstance(limit, int) or limit <= 0:
                    raise ValueError(f"capacity.{workflow}.{canvas}: rows must be a positive integer, got {limit!r}")

    def limit(self, workflow: int, height: int, width: int) -> int | None:
        canvases = self.limits.get(workflows.by_value(workflow).name, {})
        return canvases.get(canvas_key(height, width), canvases.get(ANY_CANVAS))

    def max_frames(self, limit: int, height: int, width: int, text_rows: int, condition_rows: int = 0) -> int | None:
        """The longest valid frame count whose rows fit `limit`; None when even the shortest does not."""
        fitting = [
            f for f in VALID_NUM_FRAMES if packed_rows(height, width, f, text_rows, condition_rows).total <= limit
        ]
        return fitting[-1] if fitting else None

    def admit(self, request: gateway_pb2.ResolvedRequest) -> Rows:
        """The request's rows (its `text_rows` and `condition_rows` counted); OverCapacity naming the frame ceiling
        when they exceed max_rows or the table's limit for its workflow and canvas."""
        rows = packed_rows(request.height, request.width, request.num_frames, request.text_rows, request.condition_rows)
        canvas = canvas_key(request.height, request.width)
        limits = [
            (self.max_rows, "max_rows"),
            (
                self.limit(request.workflow, request.height, request.width),
                f"{workflows.by_value(request.workflow).name} capacity at {canvas}",
            ),
        ]
        for limit, name in limits:
            if limit is not None and rows.total > limit:
                raise self._refusal(request, rows, limit, name)
        return rows

    def _refusal(self, request: gateway_pb2.ResolvedRequest, rows: Rows, limit: int, name: str) -> OverCapacity:
        canvas = canvas_key(request.height, request.width)
        ceiling = self.max_frames(limit, request.height, request.width, rows.text, rows.condition)
        if ceiling:
            field, allowed = "num_frames", f"{canvas} allows at most {ceiling} frames here"
        else:
            field = "references" if request.references else "height"
            allowed = f"{canvas} allows no video here, not even {VALID_NUM_FRAMES[0]} frames"
        return OverCapacity(
            field,
            f"{allowed}: {request.num_frames} frames need {rows.total:,} packed rows "
            f"(text {rows.text}, audio {rows.audio}, video {rows.video}, conditioning "
            f"{rows.condition}), this deployment's {name} is {limit:,}",
        )

    def table(self, text_rows: int) -> list[tuple[str, str, int, int | None]]:
        """(workflow, canvas, max rows, max frames for a prompt of `text_rows` rows) for every configured entry, its
        rows bounded by max_rows as well, as `admit` bounds them."""
        out = []
        for workflow, canvases in sorted(self.limits.items()):
            for canvas, entry in sorted(canvases.items()):
                limit = min(entry, self.max_rows or entry)
                frames = None
                if canvas != ANY_CANVAS:
                    height, width = (int(side) for side in canvas.split("x"))
                    frames = self.max_frames(limit, height, width, text_rows)
                out.append((workflow, canvas, limit, frames))
        return out
