"""The report of a recorded experiment, made from its raw data only: summary.json, one PNG per figure and one
self-contained report.html (the PNGs embedded as base64, the numbers as tables). `h3serve experiment report DIR`
runs `render` again; a sweep adds `render_overlay` over its configurations."""

from __future__ import annotations

import base64
import html
import json
import os
from pathlib import Path

from h3serve.experiment import plots
from h3serve.experiment.analysis import Run, summarise

SUMMARY_JSON, REPORT_HTML = "summary.json", "report.html"
STYLE = (
    "body{font-family:sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse;margin:0.5em 0 1.5em}"
    "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right;font-size:13px}th{background:#eee}"
    "td:first-child{text-align:left}img{max-width:100%;display:block;margin:0.5em 0 1.5em}"
)


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return html.escape(str(value))


def table(header: list[str] | None, rows: list[list]) -> str:
    head = "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(f"<td>{_cell(v)}</td>" for v in row) + "</tr>" for row in rows)
    return f"<table>{head}{body}</table>"


def _image(data: bytes, title: str) -> str:
    return f'<img alt="{html.escape(title)}" src="data:image/png;base64,{base64.b64encode(data).decode()}">'


def _page(title: str, body: str) -> str:
    return (
        f'<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>{body}</body></html>"
    )


LATENCY_HEADER = ["workflow", "jobs", "mean s", "p50 s", "p95 s", "p99 s", "max s"]


def _latency_rows(summary: dict, prefix: str = "") -> list[list]:
    return [
        [f"{prefix}{name}", s["n"], *(s.get(k, "") for k in ("mean", "p50", "p95", "p99", "max"))]
        for name, s in summary["latency_s"].items()
    ]


def _overview(run: Run, summary: dict) -> str:
    arrivals = run.meta["load"]["arrivals"]
    load = ", ".join(f"{k} {v}" for k, v in arrivals.items() if v)
    jobs = ", ".join(f"{n} {state}" for state, n in summary["jobs"].items())
    return table(
        None,
        [
            ["gateway", run.meta["gateway"]],
            ["load", load],
            ["jobs", jobs],
            ["span (first accepted to last ended)", f"{summary['span_s']:.2f} s"],
            ["offered rate", f"{summary['offered_rate_per_s']:.3f} jobs/s"],
            ["throughput", f"{summary['throughput_per_s']:.3f} jobs/s"],
        ],
    )


def _stages(summary: dict) -> str:
    rows = [
        [
            stage,
            s["replicas"],
            s["passes"],
            s["failed_passes"],
            *(s["service_s"].get(k, "") for k in ("mean", "p50", "p95")),
            s["queue_s"].get("mean", ""),
            s["queue_s"].get("p95", ""),
            s["utilisation"],
            s["mean_queue_depth"],
            s["max_queue_depth"],
            ", ".join(f"{r} {u:.2f}" for r, u in s["replica_utilisation"].items()),
        ]
        for stage, s in summary["stages"].items()
    ]
    return table(
        [
            "stage",
            "replicas",
            "passes",
            "failed",
            "service mean s",
            "p50 s",
            "p95 s",
            "queue mean s",
            "queue p95 s",
            "utilisation",
            "mean queue",
            "max queue",
            "per replica",
        ],
        rows,
    )


def _jobs(run: Run) -> str:
    stages = run.stages()
    by_job = {(row.job_id, row.stage): row for row in run.records.stages}  # the last attempt's pass
    rows = []
    for job in run.records.jobs:
        passes = [by_job.get((job.job_id, stage)) for stage in stages]
        rows.append(
            [
                job.index,
                job.job_id,
                job.workflow,
                f"{job.height}x{job.width}x{job.num_frames}",
                job.steps,
                job.state,
                job.attempts,
                job.arrival_s,
                job.latency_s,
                *(
                    f"{p.started - p.enqueued:.3f} + {p.finished - p.started:.3f}" if p and p.finished else "-"
                    for p in passes
                ),
            ]
        )
    return table(
        [
            "#",
            "job",
            "workflow",
            "canvas",
            "steps",
            "state",
            "attempts",
            "arrival s",
            "latency s",
            *(f"{s} queue + service s" for s in stages),
        ],
        rows,
    )


def render(folder: Path) -> Path:
    """Write summary.json, the PNGs and report.html into `folder` from its raw data; returns report.html."""
    run = Run.read(folder)
    summary = summarise(run)
    (folder / SUMMARY_JSON).write_text(json.dumps(summary, indent=1))
    figures = {}
    for name, draw in plots.FIGURES.items() if run.records.jobs else ():  # every Submit refused: nothing to draw
        figures[name] = plots.png(draw(run))
        (folder / f"{name}.png").write_bytes(figures[name])
    steps = summary["dit_steps_s"]
    body = (
        _overview(run, summary)
        + "<h2>Latency (accepted to done)</h2>"
        + table(LATENCY_HEADER, _latency_rows(summary))
        + "<h2>Stages</h2>"
        + _stages(summary)
        + "<h2>DiT steps</h2>"
        + table(
            ["steps", "mean s", "p50 s", "p95 s", "max s"],
            [[steps["n"], *(steps.get(k, "") for k in ("mean", "p50", "p95", "max"))]],
        )
        + "".join(f"<h2>{name.replace('_', ' ')}</h2>{_image(data, name)}" for name, data in figures.items())
        + "<h2>Jobs</h2>"
        + _jobs(run)
    )
    path = folder / REPORT_HTML
    path.write_text(_page(f"h3serve experiment: {run.label}", body))
    return path


def render_overlay(folders: list[Path], out: Path) -> Path:
    """One page over several recorded configurations: latency CDFs and throughput side by side, their tables."""
    runs = [Run.read(folder) for folder in folders]
    summaries = [summarise(run) for run in runs]
    figure = plots.png(plots.overlay(runs, [s["throughput_per_s"] for s in summaries]))
    (out / "overlay.png").write_bytes(figure)
    rows = [
        [
            s["label"],
            ", ".join(f"{k}={v}" for k, v in s["replicas"].items()),
            s["jobs"].get("succeeded", 0),
            s["offered_rate_per_s"],
            s["throughput_per_s"],
            *(s["latency_s"]["all"].get(k, "") for k in ("p50", "p95", "p99")),
        ]
        for s in summaries
    ]
    body = (
        _image(figure, "overlay")
        + table(
            ["configuration", "replicas", "done", "offered jobs/s", "throughput jobs/s", "p50 s", "p95 s", "p99 s"],
            rows,
        )
        + "<h2>Latency per workflow</h2>"
        + table(LATENCY_HEADER, [row for s in summaries for row in _latency_rows(s, f"{s['label']}: ")])
        + "".join(
            f'<p><a href="{html.escape(os.path.relpath(f / REPORT_HTML, out))}">{html.escape(r.label)}: '
            f"full report</a></p>"
            for f, r in zip(folders, runs, strict=True)
        )
    )
    path = out / REPORT_HTML
    path.write_text(_page("h3serve experiment sweep", body))
    return path
