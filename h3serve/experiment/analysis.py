"""The numbers of a recorded experiment, all from its raw data: latency per workflow, throughput, and per stage the
service and queue times, the busy replicas and the queue depth over time (step functions of the stage records).

Every time is on the gateway's clock (its job and stage records) and plotted from the first job's acceptance.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from h3serve.experiment.records import METRICS_JSON, RUN_JSON, Records, StageRow

STAGES = ("encoder", "vae-encode", "dit", "vae")  # in plan order
SERVICE_OF = {"encoder": "encoder", "vae-encode": "vae", "dit": "dit", "vae": "vae"}  # the service a stage calls
QUANTILES = (50, 95, 99)


def stats(values) -> dict[str, float]:
    """Count, mean, p50 / p95 / p99 (linear interpolation, numpy's default) and max; empty: the count only."""
    values = np.asarray(values, dtype=float)
    if not values.size:
        return {"n": 0}
    return {
        "n": int(values.size),
        "mean": float(values.mean()),
        **{f"p{q}": float(np.percentile(values, q)) for q in QUANTILES},
        "max": float(values.max()),
    }


def occupancy(intervals: list[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    """How many intervals are open from each event time on: (times, counts) of a step function starting at 0."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    times = np.array([t for t, _ in events], dtype=float)
    return times, np.cumsum([change for _, change in events])


def area(times: np.ndarray, counts: np.ndarray, at: np.ndarray) -> np.ndarray:
    """The integral of the step function (0 before its first time) from -inf up to each of `at`."""
    if not times.size:
        return np.zeros_like(at, dtype=float)
    cumulative = np.concatenate(([0.0], np.cumsum(counts[:-1] * np.diff(times))))
    k = np.searchsorted(times, at, side="right") - 1
    inside = np.clip(k, 0, None)
    return np.where(k < 0, 0.0, cumulative[inside] + counts[inside] * (at - times[inside]))


def time_average(times: np.ndarray, counts: np.ndarray, t0: float, t1: float) -> float:
    """The mean of the step function over [t0, t1]."""
    if t1 <= t0:
        return 0.0
    start, end = area(times, counts, np.array([t0, t1]))
    return float((end - start) / (t1 - t0))


def time_at_levels(times: np.ndarray, counts: np.ndarray, start: float, end: float, top: int) -> np.ndarray:
    """Seconds of [start, end] the step function spent at each value 1..top (above top counts as top)."""
    inner = times[(times > start) & (times < end)]
    edges = np.concatenate(([start], inner, [end]))
    values = counts[np.clip(np.searchsorted(times, edges[:-1], side="right") - 1, 0, None)]
    return np.array([np.diff(edges)[np.clip(values, 1, top) == level].sum() for level in range(1, top + 1)])


def binned(times: np.ndarray, counts: np.ndarray, t0: float, t1: float, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """The step function's mean over each of `bins` equal bins of [t0, t1]: (bin edges, means). A plot of the raw
    steps would show every zero-length wait as a spike and blur into a band over thousands of jobs."""
    edges = np.linspace(t0, t1, bins + 1)
    return edges, np.diff(area(times, counts, edges)) / np.diff(edges)


@dataclass(frozen=True)
class Run:
    """A recorded experiment, read from its folder."""

    folder: Path
    records: Records
    meta: dict  # run.json
    metrics: dict  # metrics.json

    @classmethod
    def read(cls, folder: Path) -> Run:
        return cls(
            folder,
            Records.read(folder),
            json.loads((folder / RUN_JSON).read_text()),
            json.loads((folder / METRICS_JSON).read_text()),
        )

    @property
    def label(self) -> str:
        return self.meta["label"]

    def replicas(self, stage: str) -> int:
        return len(self.meta["replicas"].get(stage, ())) or 1

    @cached_property
    def span(self) -> tuple[float, float]:
        """First job accepted to last job ended (gateway clock)."""
        jobs = self.records.jobs
        return (min(j.created for j in jobs), max(j.updated for j in jobs)) if jobs else (0.0, 0.0)

    @cached_property
    def _ended(self) -> dict[str, float]:
        return {job.job_id: job.updated for job in self.records.jobs}

    def passes(self, stage: str) -> list[StageRow]:
        return [row for row in self.records.stages if row.stage == stage]

    def end(self, row: StageRow) -> float:
        """When a pass let go of its replica: finished, or for a pass that failed its job's end."""
        return row.finished or self._ended[row.job_id]

    def on_replica(self, stage: str, replica: str | None = None) -> list[StageRow]:
        """The passes that got a replica (`replica`, or any)."""
        return [r for r in self.passes(stage) if r.started and replica in (None, r.replica)]

    def busy(self, stage: str, replica: str | None = None) -> list[tuple[float, float]]:
        """When each pass held a replica: started to end."""
        return [(r.started, self.end(r)) for r in self.on_replica(stage, replica)]

    def queued(self, stage: str) -> list[tuple[float, float]]:
        """When each pass waited for a replica: enqueued to started (never started: to its job's end)."""
        return [(r.enqueued, r.started or self._ended[r.job_id]) for r in self.passes(stage)]

    def stages(self) -> list[str]:
        """The stages this run's jobs passed through, in plan order."""
        seen = {row.stage for row in self.records.stages}
        return [stage for stage in STAGES if stage in seen]


def _stage_summary(run: Run, stage: str) -> dict:
    t0, t1 = run.span
    passes = run.passes(stage)
    done = [r for r in passes if r.finished]
    queue_times, queue_depth = occupancy(run.queued(stage))
    return {
        "replicas": run.replicas(stage),
        "passes": len(passes),
        "failed_passes": len(passes) - len(done),
        "service_s": stats([r.finished - r.started for r in done]),
        "queue_s": stats([r.started - r.enqueued for r in passes if r.started]),
        "utilisation": time_average(*occupancy(run.busy(stage)), t0, t1) / run.replicas(stage),
        "replica_utilisation": {
            replica: time_average(*occupancy(run.busy(stage, replica)), t0, t1)
            for replica in sorted({r.replica for r in run.on_replica(stage)})
        },
        "mean_queue_depth": time_average(queue_times, queue_depth, t0, t1),
        "max_queue_depth": int(queue_depth.max()) if queue_depth.size else 0,
    }


def summarise(run: Run) -> dict:
    """summary.json: every number of the report."""
    jobs, (t0, t1) = run.records.jobs, run.span
    done = [job for job in jobs if job.done]
    by_workflow = defaultdict(list)
    for job in done:
        by_workflow[job.workflow].append(job.latency_s)
    states: defaultdict[str, int] = defaultdict(int)
    for job in jobs:
        states[job.state] += 1
    arrivals = [job.arrival_s for job in jobs]
    return {
        "label": run.label,
        "replicas": {stage: run.replicas(stage) for stage in run.stages()},
        "jobs": {"submitted": len(jobs), **states, "rejected": len(run.meta["rejected"])},
        "span_s": t1 - t0,
        "offered_rate_per_s": (len(jobs) - 1) / (max(arrivals) - min(arrivals))
        if len(jobs) > 1 and max(arrivals) > min(arrivals)
        else 0.0,
        "throughput_per_s": len(done) / (t1 - t0) if t1 > t0 else 0.0,
        "latency_s": {
            "all": stats([job.latency_s for job in done]),
            **{workflow: stats(values) for workflow, values in sorted(by_workflow.items())},
        },
        "stages": {stage: _stage_summary(run, stage) for stage in run.stages()},
        "dit_steps_s": stats([step.step_seconds for step in run.records.steps]),
    }
