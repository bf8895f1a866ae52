"""The raw data of an experiment: one row per job, per stage pass and per DiT step, as CSV files that read back
to the same values (Python writes a float's shortest repr, which reads back exactly).

Jobs and stage passes are the gateway's own records (GetJob); steps come from the jobs' `denoising` events (Watch).
"""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from h3serve.model.workflows import by_value
from h3serve.v1 import gateway_pb2

JOBS_CSV, STAGES_CSV, STEPS_CSV = "jobs.csv", "stage_records.csv", "steps.csv"
RUN_JSON = "run.json"  # the run itself: gateway, replicas per stage, start and end, the load, rejections
METRICS_JSON = "metrics.json"  # the gateway's Prometheus series, scraped (scrape.py)


@dataclasses.dataclass(frozen=True)
class JobRow:
    job_id: str
    index: int  # the job's number in the run (also its seed)
    workflow: str
    height: int
    width: int
    num_frames: int
    steps: int  # num_inference_steps, resolved
    state: str  # succeeded, failed, cancelled (or queued / running if it never ended)
    attempts: int
    created: float  # unix seconds, the gateway's clock: the job was accepted ...
    updated: float  # ... and ended (its last event)
    arrival_s: float  # when the load asked for it, seconds from the run's start (closed loop: when submitted)
    submitted: float  # unix seconds, the client's clock, before Submit

    @property
    def latency_s(self) -> float:
        """Accepted to ended, on the gateway's clock."""
        return self.updated - self.created

    @property
    def job_class(self) -> str:
        """What its service times depend on: workflow, canvas, frames and steps."""
        return f"{self.workflow} {self.height}x{self.width}x{self.num_frames} {self.steps} steps"

    @property
    def done(self) -> bool:
        return self.state == "succeeded"


@dataclasses.dataclass(frozen=True)
class StageRow:
    job_id: str
    stage: str  # encoder, vae-encode, dit, vae
    attempt: int
    enqueued: float  # unix seconds (gateway): joined the stage's queue
    started: float  # a worker and replica took it (0: never)
    finished: float  # the call returned (0: never, or failed)
    replica: str
    tries: int
    bytes_in: int
    bytes_out: int
    error: str


@dataclasses.dataclass(frozen=True)
class StepRow:
    job_id: str
    attempt: int
    step: int  # 1-based
    total: int
    step_seconds: float  # the DiT's wall time of this step
    time: float  # unix seconds of the event (gateway)


def job_row(job: gateway_pb2.Job, index: int, arrival_s: float, submitted: float) -> JobRow:
    r = job.request
    return JobRow(
        job.job_id,
        index,
        by_value(r.workflow).name,
        r.height,
        r.width,
        r.num_frames,
        r.params.num_inference_steps,
        gateway_pb2.JobState.Name(job.state).removeprefix("JOB_STATE_").lower(),
        job.attempts,
        job.created,
        job.updated,
        arrival_s,
        submitted,
    )


def stage_rows(job: gateway_pb2.Job) -> list[StageRow]:
    return [
        StageRow(
            job.job_id,
            s.stage,
            s.attempt,
            s.enqueued,
            s.started,
            s.finished,
            s.replica,
            s.tries,
            s.bytes_in,
            s.bytes_out,
            s.error,
        )
        for s in job.stage_records
    ]


def step_row(event: gateway_pb2.JobEvent, attempt: int) -> StepRow:
    d = event.denoising
    return StepRow(event.job_id, attempt, d.step, d.total, d.step_seconds, event.time)


if TYPE_CHECKING:
    from _typeshed import DataclassInstance

Row = TypeVar("Row", bound="DataclassInstance")
_TYPES: dict[str | type, type] = {"int": int, "float": float, "str": str}  # by annotation (a string here)


def write_rows(path: Path, rows: list, kind: type) -> None:
    names = [f.name for f in dataclasses.fields(kind)]
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(names)
        writer.writerows(dataclasses.astuple(row) for row in rows)


def read_rows(path: Path, kind: type[Row]) -> list[Row]:
    types = {f.name: _TYPES[f.type] for f in dataclasses.fields(kind)}
    with open(path, newline="") as file:
        return [kind(**{name: types[name](value) for name, value in row.items()}) for row in csv.DictReader(file)]


@dataclasses.dataclass(frozen=True)
class Records:
    jobs: list[JobRow]
    stages: list[StageRow]
    steps: list[StepRow]

    def write(self, folder: Path) -> None:
        write_rows(folder / JOBS_CSV, self.jobs, JobRow)
        write_rows(folder / STAGES_CSV, self.stages, StageRow)
        write_rows(folder / STEPS_CSV, self.steps, StepRow)

    @classmethod
    def read(cls, folder: Path) -> Records:
        return cls(
            read_rows(folder / JOBS_CSV, JobRow),
            read_rows(folder / STAGES_CSV, StageRow),
            read_rows(folder / STEPS_CSV, StepRow),
        )
