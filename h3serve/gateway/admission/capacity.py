"""Admission by capacity: the DiT's packed sequence must fit what this deployment's cards hold.

Peak memory grows with the packed-sequence length and the decoded pixels, so a request over what the
deployment holds is refused at submit with the frame ceiling that does fit, instead of failing after minutes
in the queue. What it holds comes from the memory plan (`planned`: h3serve/common/ceilings.py, the ceilings
`h3serve plan` prints, per canvas and frame count), unless the deployment states it: a hand-set table (per
workflow and canvas, the most rows its DiT replicas take, measured: docs/capacity.md) overrides the plan
where it has an entry. The rows are counted by the request's workflow (h3serve/model/workflows: text rows
with the deployment's tokenizer, conditioning rows) and the model's rules (the generated video and audio).
Besides both, `max_rows` bounds every request.

Every refusal is `OverCapacity`, answered INVALID_ARGUMENT: the same request is refused again by this
deployment, so a client must change it (the message gives the frame ceiling) rather than retry it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from h3serve.common.ceilings import Ceilings
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
class Bound:
    """One bound on a request's rows: its name in a refusal, and the most rows it admits at a frame count (None:
    no clip of that length)."""

    name: str
    rows_at: Callable[[int], int | None]


@dataclass(frozen=True)
class CapacityTable:
    """{workflow name ("t2va"): {"HxW" or "*": max rows}} from the deployment file, `max_rows` for any request, and
    the plan's ceilings where the table has no entry."""

    limits: dict
    max_rows: int | None = None
    planned: Ceilings | None = None

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

    def bounds(self, request: gateway_pb2.ResolvedRequest) -> list[Bound]:
        """What bounds this request: max_rows, then the table's entry for its workflow and canvas, else the plan's
        ceiling for its canvas (per frame count)."""
        height, width, canvas = request.height, request.width, canvas_key(request.height, request.width)
        found = [Bound("max_rows", lambda frames: self.max_rows)] if self.max_rows is not None else []
        entry = self.limit(request.workflow, height, width)
        if entry is not None:
            found.append(Bound(f"{workflows.by_value(request.workflow).name} capacity at {canvas}", lambda f: entry))
        elif self.planned is not None and self.planned.bounded:
            planned = self.planned
            name = f"plan's ceiling for {canvas}x{request.num_frames} on {planned.cards}"
            found.append(Bound(name, lambda frames: planned.rows(height, width, frames)))
        return found

    def admit(self, request: gateway_pb2.ResolvedRequest) -> Rows:
        """The request's rows (its `text_rows` and `condition_rows` counted); OverCapacity naming the frame ceiling
        when they exceed max_rows, the table's limit for its workflow and canvas, or the plan's ceiling."""
        rows = packed_rows(request.height, request.width, request.num_frames, request.text_rows, request.condition_rows)
        for bound in self.bounds(request):
            limit = bound.rows_at(request.num_frames)
            if limit is None or rows.total > limit:
                raise self._refusal(request, rows, bound, limit)
        return rows

    def _refusal(
        self, request: gateway_pb2.ResolvedRequest, rows: Rows, bound: Bound, limit: int | None
    ) -> OverCapacity:
        canvas = canvas_key(request.height, request.width)
        held = [
            frames
            for frames in VALID_NUM_FRAMES
            if (most := bound.rows_at(frames)) is not None
            and packed_rows(request.height, request.width, frames, rows.text, rows.condition).total <= most
        ]
        ceiling = held[-1] if held else None
        if ceiling:
            field, allowed = "num_frames", f"{canvas} allows at most {ceiling} frames here"
        else:
            field = "references" if request.references else "height"
            allowed = f"{canvas} allows no video here, not even {VALID_NUM_FRAMES[0]} frames"
        held_here = f"is {limit:,}" if limit is not None else "holds not even the clip's own rows"
        return OverCapacity(
            field,
            f"{allowed}: {request.num_frames} frames need {rows.total:,} packed rows "
            f"(text {rows.text}, audio {rows.audio}, video {rows.video}, conditioning "
            f"{rows.condition}), this deployment's {bound.name} {held_here}",
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
