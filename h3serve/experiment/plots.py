"""The report's figures, drawn with matplotlib's object API on the Agg canvas (no pyplot: no global state, no
display). Times are seconds from the run's first job (Run.span)."""

from __future__ import annotations

import io

import numpy as np
from matplotlib.figure import Figure

from h3serve.experiment.analysis import Run, binned, occupancy

DPI = 80
COLOURS = [f"C{i}" for i in range(10)]


def png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI, bbox_inches="tight")
    return buffer.getvalue()


BINS = 100


def _binned(axes, intervals, run: Run, scale: float = 1.0, **style) -> None:
    """The mean number of open intervals per bin (of BINS over the run), divided by `scale`."""
    t0, t1 = run.span
    edges, means = binned(*occupancy(intervals), t0, t1, BINS)
    axes.stairs(means / scale, edges - t0, **style)


def utilisation(run: Run) -> Figure:
    """Busy replicas / replicas per stage over time (mean per bin): 1 is a stage with every replica working."""
    stages = run.stages()
    figure = Figure(figsize=(8, 1.6 * len(stages) + 0.6))
    for number, (axes, stage) in enumerate(
        zip(figure.subplots(len(stages), 1, sharex=True, squeeze=False)[:, 0], stages, strict=True)
    ):
        _binned(axes, run.busy(stage), run, run.replicas(stage), color=COLOURS[number])
        axes.set_ylim(-0.05, 1.05)
        axes.set_ylabel("busy", fontsize=8)
        axes.set_title(f"{stage}: {run.replicas(stage)} replica(s)", fontsize=9, loc="left")
    axes.set_xlabel("seconds")
    figure.suptitle("utilisation: busy replicas / replicas")
    return figure


def queue_depth(run: Run) -> Figure:
    """Jobs waiting for a replica per stage (mean per bin), from the stage records (lines), and the gateway's
    h3serve_stage_queue_depth gauge as scraped (dots)."""
    figure = Figure(figsize=(8, 3))
    axes = figure.subplots()
    t0 = run.span[0]
    for number, stage in enumerate(run.stages()):
        _binned(axes, run.queued(stage), run, label=stage, color=COLOURS[number])
        key = f'h3serve_stage_queue_depth{{stage="{stage}"}}'
        scraped = [(s["time"] - t0, s["series"][key]) for s in run.metrics["scrapes"] if key in s["series"]]
        if scraped:
            axes.plot(*zip(*scraped, strict=True), ".", color=COLOURS[number], markersize=4)
    axes.set_xlabel("seconds")
    axes.set_ylabel("jobs waiting")
    axes.legend(fontsize=8)
    axes.set_title("queue depth per stage (dots: the gateway's gauge, scraped)")
    return figure


def _cdf(axes, values, **style) -> None:
    values = np.sort(values)
    axes.step(values, np.arange(1, values.size + 1) / values.size, where="post", **style)


def latency_cdf(run: Run) -> Figure:
    """Accepted-to-done latency of the jobs that succeeded, one curve per workflow."""
    figure = Figure(figsize=(6, 3.5))
    axes = figure.subplots()
    for workflow in sorted({job.workflow for job in run.records.jobs}):
        values = [job.latency_s for job in run.records.jobs if job.done and job.workflow == workflow]
        if values:
            _cdf(axes, values, label=f"{workflow} ({len(values)} jobs)")
    axes.set_xlabel("latency, seconds")
    axes.set_ylabel("fraction of jobs")
    axes.legend(fontsize=8)
    axes.set_title("latency CDF per workflow")
    return figure


def throughput(run: Run) -> Figure:
    """Jobs accepted and jobs done over time: the gap between the curves is the jobs in the system."""
    figure = Figure(figsize=(6, 3.5))
    axes = figure.subplots()
    t0 = run.span[0]
    for label, values in (
        ("accepted", [j.created for j in run.records.jobs]),
        ("done", [j.updated for j in run.records.jobs if j.done]),
    ):
        times = np.sort(np.asarray(values)) - t0
        axes.step(np.append(0.0, times), np.arange(times.size + 1), where="post", label=label)
    axes.set_xlabel("seconds")
    axes.set_ylabel("jobs")
    axes.legend(fontsize=8)
    axes.set_title("arrivals and completions")
    return figure


def timeline(run: Run) -> Figure:
    """A Gantt chart: one lane per replica of each stage, one bar per stage pass (started to finished), coloured
    by job, so a job can be followed from lane to lane."""
    lanes = [
        (stage, replica) for stage in run.stages() for replica in sorted({r.replica for r in run.on_replica(stage)})
    ]
    colour = {job.job_id: COLOURS[job.index % len(COLOURS)] for job in run.records.jobs}
    figure = Figure(figsize=(9, 0.45 * len(lanes) + 1.2))
    axes = figure.subplots()
    t0 = run.span[0]
    for lane, (stage, replica) in enumerate(lanes):
        rows = run.on_replica(stage, replica)
        axes.broken_barh(
            [(r.started - t0, run.end(r) - r.started) for r in rows],
            (lane - 0.4, 0.8),
            facecolors=[colour[r.job_id] for r in rows],
            edgecolor="black",
            linewidth=0.3,
        )
    axes.set_yticks(range(len(lanes)), [f"{stage} @ {replica}" for stage, replica in lanes], fontsize=7)
    axes.invert_yaxis()
    axes.set_xlabel("seconds")
    axes.set_title("timeline: every stage pass on every replica (colour: job)")
    return figure


def dit_steps(run: Run) -> Figure:
    """The DiT's per-step wall times, from the jobs' denoising events."""
    figure = Figure(figsize=(6, 3))
    axes = figure.subplots()
    axes.hist([step.step_seconds for step in run.records.steps], bins=30)
    axes.set_xlabel("seconds per denoise step")
    axes.set_ylabel("steps")
    axes.set_title("DiT step times")
    return figure


FIGURES = {
    "utilisation": utilisation,
    "queue_depth": queue_depth,
    "latency_cdf": latency_cdf,
    "throughput": throughput,
    "timeline": timeline,
    "dit_steps": dit_steps,
}


def overlay(runs: list[Run], throughputs: list[float]) -> Figure:
    """Several configurations side by side: latency CDFs (every succeeded job) and throughput (jobs/s)."""
    figure = Figure(figsize=(11, 3.8))
    cdf_axes, bar_axes = figure.subplots(1, 2, width_ratios=(3, 2))
    for run in runs:
        _cdf(cdf_axes, [job.latency_s for job in run.records.jobs if job.done], label=run.label)
    cdf_axes.set_xlabel("latency, seconds")
    cdf_axes.set_ylabel("fraction of jobs")
    cdf_axes.legend(fontsize=8)
    cdf_axes.set_title("latency CDF")
    bar_axes.bar([run.label for run in runs], throughputs, color=COLOURS[: len(runs)])
    bar_axes.set_ylabel("jobs done per second")
    bar_axes.set_title("throughput")
    bar_axes.tick_params(axis="x", labelsize=8, labelrotation=20)
    return figure
