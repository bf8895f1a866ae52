"""The largest request each workflow can hold on a deployment's cards, from the memory plan `h3serve plan` prints.

The field notes' lesson: refuse at submit what would run out of memory after minutes in a queue. The plan
(h3serve/common/memory_plan.py) predicts every GPU's peak for one request from its canvas, its frames and its packed
DiT rows: the DiT's activations grow with the rows, the VAE's with the decoded pixels. For a canvas and a frame
count the row ceiling is the most rows whose plan fits every GPU (each process within its `memory_limit_gib`, each
card within its size); the gateway admits a request whose rows are within the ceiling of its canvas and frames
(h3serve/gateway/admission/capacity.py), so a request gets the ceiling for its own prompt and conditioning.

The longest clip a workflow holds at a canvas (what `h3serve plan` prints) is planned with `text_rows` prompt rows and
the conditioning the plan assumes (two keyframes for fl2va; a ref2va request's references are counted at submit).
A canvas's memory depends on its area only (rows per latent frame = area / 1024): ceilings are kept per area.
A deployment whose cards cannot hold the smallest canvas (32x32) at the shortest clip is refused (`refusal`).
"""

from __future__ import annotations

from dataclasses import dataclass

from h3serve.common.config import ConfigError, DeployConfig, parse_shape
from h3serve.common.memory_plan import DEFAULT_TEXT_ROWS, Plan, plan, workload
from h3serve.model import rules

SMALLEST_CANVAS = (rules.CANVAS_MULTIPLE, rules.CANVAS_MULTIPLE)
SHORTEST = rules.VALID_NUM_FRAMES[0]
NAMED_CANVASES = ((768, 1344), (480, 832))  # the model's two usual sizes, printed when a deployment serves them
SEARCHED_ROWS = 1 << 20  # rows above a clip's own that the ceiling search tries: more than any prompt and references


@dataclass(frozen=True)
class Ceiling:
    """The longest clip `workflow` holds at a canvas, and the packed rows the plan holds at that clip."""

    workflow: str
    height: int
    width: int
    frames: int | None  # None: not even the shortest clip
    rows: int | None

    @property
    def canvas(self) -> str:
        return f"{self.height}x{self.width}"

    def describe(self) -> str:
        if self.frames is None:
            return f"{self.canvas}: refused (not even {SHORTEST} frames)"
        return f"{self.canvas}: up to {self.frames} frames ({self.rows:,} rows)"


def planned_condition(workflow: str, height: int, width: int) -> int:
    """The conditioning rows a workflow's printed ceiling assumes: two keyframes for fl2va, as the plan does."""
    return 2 * rules.rows_per_latent_frame(height, width) if workflow == "fl2va" else 0


def fits(result: Plan) -> bool:
    """Every GPU of the plan holds its processes: each within its memory_limit_gib, the card within its size."""
    return all(
        gpu.card is not None
        and gpu.used <= gpu.card
        and all(not share.limit or share.allocator <= share.limit for share in gpu.shares)
        for gpu in result.gpus
    )


def gpu_problems(result: Plan) -> list[str]:
    """The plan's own lines for what does not fit on a GPU (its host lines are about the start, not a request)."""
    return [problem for problem in result.problems if problem.startswith("GPU ")]


class Ceilings:
    """The plan's ceilings for one deployment on its cards (`gpu_gib`: every GPU's size, as `h3serve plan --gpu-gib`
    gives it; else the deployment's own). `bounded` is False where the plan bounds nothing (no service on a GPU, or a
    card of unknown size: `unbounded` says which)."""

    def __init__(self, config: DeployConfig, gpu_gib: float | None = None, text_rows: int = DEFAULT_TEXT_ROWS) -> None:
        self.config, self.gpu_gib, self.text_rows = config, gpu_gib, text_rows
        self._held: dict[tuple[int, int], int | None] = {}  # (area, frames): rows; asked again at every submit
        smallest = self._plan(SMALLEST_CANVAS, SHORTEST, 0)
        unknown = [gpu.gpu for gpu in smallest.gpus if gpu.card is None]
        self.unbounded = (
            "no model service is on a GPU"
            if not smallest.gpus
            else f"GPU {', '.join(unknown)}: card size unknown (set [supervisor] gpu_memory_gib)"
            if unknown
            else ""
        )
        self.bounded = not self.unbounded
        known = [gpu for gpu in smallest.gpus if gpu.card]
        self.cards = "; ".join(f"GPU {gpu.gpu} {gpu.card:g} GiB ({gpu.card_source})" for gpu in known)

    def _plan(self, canvas: tuple[int, int], frames: int, extra_rows: int) -> Plan:
        """The plan at `canvas` x `frames` with the video's rows and `extra_rows` more (the plan's own conditioning
        included), its host not checked (the host is the start's matter, not a request's)."""
        return plan(self.config, self.gpu_gib, canvas, frames, text_rows=extra_rows, host_gib=0)

    def rows(self, height: int, width: int, frames: int) -> int | None:
        """The most packed rows the plan holds at this canvas and frame count; None when not even the video's own."""
        key = (height * width, frames)
        if key not in self._held:
            self._held[key] = self._search(*key)
        return self._held[key]

    def _search(self, area: int, frames: int) -> int | None:
        canvas = (rules.CANVAS_MULTIPLE, area // rules.CANVAS_MULTIPLE)  # same area, same plan
        base = workload(self.config, canvas, frames, 0).rows  # the video, audio (and planned keyframe) rows
        if not fits(self._plan(canvas, frames, 0)):
            return None
        low, high = base, base + SEARCHED_ROWS
        if fits(self._plan(canvas, frames, high - base)):
            return high
        while high - low > 1:  # fits at low, not at high
            middle = (low + high) // 2
            low, high = (middle, high) if fits(self._plan(canvas, frames, middle - base)) else (low, middle)
        return low

    def admitted_rows(self, height: int, width: int, frames: int) -> int | None:
        """The plan's ceiling bounded by [gateway] max_rows too, as admission bounds a request."""
        held = self.rows(height, width, frames)
        return None if held is None else min(held, self.config.gateway.max_rows)

    def ceiling(self, workflow: str, height: int, width: int) -> Ceiling:
        """The workflow's longest clip admitted at a canvas with the plan's prompt rows and conditioning."""
        condition = planned_condition(workflow, height, width)
        frames = None
        for count in rules.VALID_NUM_FRAMES:
            held = self.admitted_rows(height, width, count)
            if held is None or self.text_rows + condition + rules.generated_rows(height, width, count).total > held:
                break
            frames = count
        return Ceiling(
            workflow, height, width, frames, None if frames is None else self.admitted_rows(height, width, frames)
        )

    def canvases(self) -> list[tuple[int, int]]:
        """The canvases to print: the deployment's default, its warm-up shapes' and the model's usual sizes that it
        serves, largest first."""
        geometry = self.config.gateway.geometry
        shapes = [parse_shape(shape)[:2] for shape in self.config.dit.warmup]
        listed = [geometry.default_canvas, *shapes, *NAMED_CANVASES]
        served = [(h, w) for h, w in listed if h * w <= geometry.canvas_max_pixels]
        return sorted(dict.fromkeys(served), key=lambda canvas: -canvas[0] * canvas[1])

    def table(self) -> list[Ceiling]:
        return [
            self.ceiling(workflow, height, width)
            for workflow in self.config.dit.workflows
            for height, width in self.canvases()
        ]

    def largest_frames(self, canvas: tuple[int, int] | None = None) -> int | None:
        """The longest clip admitted at `canvas` (default: the deployment's default canvas) with the plan's own
        request (its prompt rows, keyframes where fl2va is served), bounded by max_rows and the capacity table as
        well: what `h3serve plan` plans for. The shortest when none is held (its plan says why); None: unbounded."""
        if not self.bounded:
            return None
        height, width = canvas or self.config.gateway.geometry.default_canvas
        admitted = workload(self.config, (height, width), None, self.text_rows).frames or SHORTEST
        held = [
            frames
            for frames in rules.VALID_NUM_FRAMES
            if frames <= admitted
            and (ceiling := self.rows(height, width, frames)) is not None
            and workload(self.config, (height, width), frames, self.text_rows).rows <= ceiling
        ]
        return held[-1] if held else SHORTEST

    def refusal(self) -> str | None:
        """Why the deployment cannot hold even the smallest canvas's shortest clip (the plan's lines); None if it can
        or the plan bounds nothing."""
        if not self.bounded or self.rows(*SMALLEST_CANVAS, SHORTEST) is not None:
            return None
        problems = gpu_problems(self._plan(SMALLEST_CANVAS, SHORTEST, 0))
        return (
            f"not even a {SMALLEST_CANVAS[0]}x{SMALLEST_CANVAS[1]} clip of {SHORTEST} frames fits this deployment's "
            f"cards ({self.cards}): " + "; ".join(problems)
        )

    def lines(self) -> list[str]:
        """What `h3serve plan` prints: each workflow's largest request, canvas by canvas."""
        if not self.bounded:
            return [f"largest request per workflow: not bounded by the plan ({self.unbounded})"]
        out = [
            f"largest request per workflow (the plan's ceilings on {self.cards}, {self.text_rows} prompt rows; "
            "the gateway refuses above them):"
        ]
        table = self.table()
        for workflow in self.config.dit.workflows:
            mine = [ceiling for ceiling in table if ceiling.workflow == workflow]
            rows = max((ceiling.rows or 0) for ceiling in mine)
            most = f"up to {rows:,} packed rows" if rows else "no request"
            out.append(f"  {workflow:<6} {most}; " + ", ".join(ceiling.describe() for ceiling in mine))
        return out

    def lowered(self) -> list[str]:
        """Where the configured bounds ([gateway] max_rows) admit a longer clip than the plan holds: a line each, for
        the gateway's log when it starts with the plan's lower bounds."""
        out = []
        for ceiling in self.table() if self.bounded else []:
            condition = planned_condition(ceiling.workflow, ceiling.height, ceiling.width)
            configured = [
                frames
                for frames in rules.VALID_NUM_FRAMES
                if self.text_rows + condition + rules.generated_rows(ceiling.height, ceiling.width, frames).total
                <= self.config.gateway.max_rows
            ]
            if configured and (ceiling.frames or 0) < configured[-1]:
                held = "no clip" if ceiling.frames is None else f"{ceiling.frames} frames ({ceiling.rows:,} rows)"
                out.append(
                    f"{ceiling.workflow} at {ceiling.canvas}: [gateway] max_rows {self.config.gateway.max_rows:,} "
                    f"admits {configured[-1]} frames, the plan holds {held} on {self.cards}: lowered to the plan's"
                )
        return out


def require_holding(config: DeployConfig, path: str | None) -> None:
    """`h3serve up`'s check before it starts anything: ConfigError with the plan's reason when the deployment's cards
    cannot hold even the smallest clip (the gateway refuses such a deployment at its start too)."""
    if reason := Ceilings(config).refusal():
        raise ConfigError(f"{path or 'the deployment'}: {reason}")
