"""The load file of an experiment (TOML): how jobs arrive, when the run ends, and the mix of jobs.

    seed = 7                          # arrivals, the mix's draws and the jobs' seeds
    [arrivals]
    process = "poisson"               # "poisson" (rate), "trace" (trace) or "closed" (concurrency)
    rate = 0.5                        # jobs per second
    [bounds]
    max_jobs = 40                     # stop submitting after this many jobs ...
    max_seconds = 600                 # ... or this many seconds, whichever comes first
    [[mix]]
    workflow = "t2va"
    weight = 3                        # relative share of the jobs
    height = 32
    width = 64
    steps = 4

Every key is checked by type and range when the file is read (strict: "4" is not 4); a refusal names the file and
the key, one line per problem. Relative paths (trace, media) are relative to the load file.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from h3serve.common.config import ConfigError
from h3serve.model import adapters
from h3serve.model.rules import CANVAS_MULTIPLE, MIN_STEPS, VALID_NUM_FRAMES
from h3serve.model.workflows import by_name, names

if TYPE_CHECKING:  # pydantic's own dependency; read by the type checker only
    from pydantic_core import ErrorDetails


class Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


def existing(path: str, info: ValidationInfo) -> str:
    """A file path made absolute against the load file's directory; it must exist."""
    if not path:
        return path
    if info.context is None:
        raise TypeError("a load file is validated with its directory as the context's base")
    full = Path(info.context["base"]) / path
    if not full.is_file():
        raise ValueError(f"no such file: {full}")
    return str(full)


def read_trace(path: str) -> tuple[float, ...]:
    """Arrival times, seconds from the start, one per line ('#' comments and blank lines skipped), non-decreasing."""
    times: list[float] = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            time = float(text)
        except ValueError:
            raise ValueError(f"{path} line {number}: not a number: {text!r}") from None
        if not 0 <= time < float("inf") or (times and time < times[-1]):
            raise ValueError(f"{path} line {number}: arrival times must be finite, >= 0 and non-decreasing, got {text}")
        times.append(time)
    if not times:
        raise ValueError(f"{path}: no arrival times")
    return tuple(times)


class Arrivals(Spec):
    process: Literal["poisson", "trace", "closed"]
    rate: PositiveFloat | None = None  # poisson: jobs per second (exponential gaps)
    trace: str = ""  # trace: a file of arrival times (read_trace)
    concurrency: PositiveInt | None = None  # closed: jobs in flight at all times (a new one when one ends)

    _trace_exists = field_validator("trace")(existing)

    @model_validator(mode="after")
    def _one_parameter(self) -> Arrivals:
        needed = {"poisson": "rate", "trace": "trace", "closed": "concurrency"}[self.process]
        given = [key for key in ("rate", "trace", "concurrency") if getattr(self, key)]
        if needed not in given:
            raise ValueError(f"process {self.process!r} needs {needed}")
        if extra := [key for key in given if key != needed]:
            raise ValueError(f"process {self.process!r} takes {needed} only, not {', '.join(extra)}")
        if self.trace:
            read_trace(self.trace)
        return self


class Bounds(Spec):
    max_jobs: PositiveInt | None = None  # jobs submitted at most
    max_seconds: PositiveFloat | None = None  # no job is submitted after this many seconds
    drain_s: PositiveFloat = 600.0  # then jobs still running get this long to end; the rest are cancelled

    @model_validator(mode="after")
    def _bounded(self) -> Bounds:
        if self.max_jobs is None and self.max_seconds is None:
            raise ValueError("give max_jobs, max_seconds or both: an experiment must end")
        return self


if TYPE_CHECKING:  # a Literal of the workflows' names at run time, which a type checker cannot read
    WorkflowName = str
else:
    WorkflowName = Literal[tuple(names())]


class MixEntry(Spec):
    workflow: WorkflowName
    weight: PositiveFloat = 1.0
    height: NonNegativeInt = 0  # 0 with width 0: the deployment's default canvas
    width: NonNegativeInt = 0
    num_frames: NonNegativeInt = 0  # 0: the default (124)
    steps: NonNegativeInt = 0  # num_inference_steps; 0: the deployment's default_steps
    prompt: str = Field("an experiment clip, take {index}", min_length=1)  # {index}: the job's number (a fixed
    # prompt hits the encoder's cache)
    first_frame: str = ""  # fl2va: image files; neither: a PNG of the canvas is made
    last_frame: str = ""
    references: tuple[str, ...] = Field((), strict=False)  # ref2va: files, in order; none: a PNG and a WAV are made
    adapters: tuple[str, ...] = Field((), strict=False)  # LoRA adapters of the DiT, "name[:weight]", in order

    _files_exist = field_validator("first_frame", "last_frame")(existing)

    @field_validator("references")
    @classmethod
    def _references_exist(cls, paths: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        return tuple(existing(path, info) for path in paths)

    @field_validator("adapters")
    @classmethod
    def _adapters_parse(cls, given: tuple[str, ...]) -> tuple[str, ...]:
        for text in given:
            adapters.parse(text)  # the deployment checks the names when the job is submitted
        return given

    @field_validator("height", "width")
    @classmethod
    def _canvas_multiple(cls, side: int) -> int:
        if side % CANVAS_MULTIPLE:
            raise ValueError(f"must be a multiple of {CANVAS_MULTIPLE}, got {side}")
        return side

    @field_validator("num_frames")
    @classmethod
    def _frames(cls, frames: int) -> int:
        if frames and frames not in VALID_NUM_FRAMES:
            raise ValueError(f"must be 17n+5 in {VALID_NUM_FRAMES[0]}..{VALID_NUM_FRAMES[-1]}, got {frames}")
        return frames

    @field_validator("steps")
    @classmethod
    def _steps(cls, steps: int) -> int:
        if steps and steps < MIN_STEPS:
            raise ValueError(f"must be at least {MIN_STEPS} (or 0: the deployment's default), got {steps}")
        return steps

    @model_validator(mode="after")
    def _consistent(self) -> MixEntry:
        if bool(self.height) != bool(self.width):
            raise ValueError("height and width go together: give both or neither")
        fields = {"first_frame": self.first_frame, "last_frame": self.last_frame, "references": self.references}
        wrong = [key for key, value in fields.items() if value and key not in by_name(self.workflow).media_fields]
        if wrong:
            raise ValueError(f"a {self.workflow} job takes no {', '.join(wrong)}")
        return self


class Metrics(Spec):
    scrape_s: PositiveFloat = 1.0  # seconds between scrapes of the gateway's /metrics


class LoadSpec(Spec):
    seed: NonNegativeInt = 0
    warmup: NonNegativeInt = 0  # jobs of each mix entry run one at a time before the load, not recorded: the first
    # call of each shape pays one-time costs (allocations, kernel choices)
    arrivals: Arrivals
    bounds: Bounds
    mix: tuple[MixEntry, ...] = Field(strict=False)
    metrics: Metrics = Field(default_factory=Metrics)

    @field_validator("mix")
    @classmethod
    def _some_jobs(cls, mix: tuple[MixEntry, ...]) -> tuple[MixEntry, ...]:
        if not mix:
            raise ValueError("at least one [[mix]] entry is required")
        return mix


def _describe(problem: ErrorDetails) -> str:
    key = ".".join(str(part) for part in problem["loc"] if part != "[key]")  # a dict key's problem: the key itself
    if problem["type"] == "extra_forbidden":
        return f"{key}: unknown key"
    if problem["type"] == "missing":
        return f"{key}: required"
    message = problem["msg"].removeprefix("Value error, ")
    return f"{key}: {message}" if problem["type"] == "value_error" else f"{key}: {message} (got {problem['input']!r})"


def read_checked(path: str | Path, model: type[Spec]):
    """Read a TOML file into `model`; ConfigError with one line per problem, each naming the file and the key.
    Relative paths in it are taken from the file's directory."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    try:
        return model.model_validate(data, context={"base": Path(path).resolve().parent})
    except ValidationError as error:
        raise ConfigError("\n".join(f"{path} {_describe(problem)}" for problem in error.errors())) from None


def load_spec(path: str | Path) -> LoadSpec:
    return read_checked(path, LoadSpec)


def weights(spec: LoadSpec) -> tuple[float, ...]:
    """The mix's shares, normalised to sum to 1."""
    total = sum(entry.weight for entry in spec.mix)
    return tuple(entry.weight / total for entry in spec.mix)
