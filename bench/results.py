"""bench/results.json (one record per measurement) and the BENCHMARKS.md table made from it."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Record:
    name: str
    device: str
    world_size: int
    dtype: str
    seconds: float
    baseline_seconds: float
    ratio: float  # baseline_seconds / seconds, both from the same run
    peak_gib: float
    command: str
    date: str
    variant: str
    baseline: str
    software: str
    # Accuracy, relative L2 of the forward output against an fp32 forward of the same weights and
    # inputs (None: not measured): this variant's, bf16 eager's (the yardstick), and this
    # variant's against bf16 eager (reported for the lossy fp8 option).
    rel_err_fp32: float | None = None
    bf16_rel_err_fp32: float | None = None
    rel_err_bf16: float | None = None
    rank_peaks_gib: list[float] = field(default_factory=list)  # per rank, for multi-rank measurements
    # processes sharing GPUs: each one's own peak, whenever it came (what `h3serve plan` adds up); peak_gib is the
    # most they held together at one moment
    process_peaks_gib: dict[str, float] = field(default_factory=dict)
    tflops: float | None = None  # achieved rate from the counted FLOPs (bench/flops.py)
    ceiling_tflops: float | None = None  # the device's matmul rate, measured in the same run
    # Host memory, the most its processes held together from their start on (None: not sampled; bench/common.py
    # host_peak): private (RssAnon + RssShmem, what the OOM killer counts), mapped file pages (RssFile, page cache),
    # the system's used memory (MemTotal - MemAvailable) over its value at the start.
    host_peak_gib: float | None = None
    host_file_gib: float | None = None
    host_used_gib: float | None = None
    # The transformer's weights in one format (bench/gguf_step.py; None elsewhere): their bytes on the device, the
    # seconds to have them there (built, loaded from the file and moved, or converted), the process's peak resident
    # size meanwhile (VmHWM), the size of the file they were loaded from (GGUF). Such records have their own table.
    weights_gib: float | None = None
    load_seconds: float | None = None
    host_hwm_gib: float | None = None
    file_gib: float | None = None
    # A fault walk (bench/fault_walk.py; None elsewhere): its acknowledged jobs by how they ended and the attempts they
    # used (`WALK_COUNTS`), each kill's seconds to the victim SERVING again (None: not within the walk's limit), and
    # for a kill of the fp8 save what the cache held after; `seconds` runs from the last kill to the last job's end,
    # and no baseline is measured. Such records have their own table.
    jobs: dict[str, int] | None = None
    back_seconds: list[float | None] | None = None
    fp8_cache_after: str | None = None

    def key(self) -> tuple:
        return self.name, self.device, self.world_size, self.dtype, self.variant


HEADER = """# Benchmarks

Every row was produced by the command in its row, with the in-process diffusers baseline measured
in the same run (ratio = baseline seconds / our seconds; above 1 means faster than diffusers).
Generated from `bench/results.json` by the benchmark scripts; do not edit by hand.

| date | measurement | device | dtype | variant | seconds | baseline | baseline s | ratio | peak GiB |\
 host GiB private (+ mapped files; system used) | TFLOP/s (% of matmul ceiling) |\
 err vs fp32 (bf16 eager) | software | command |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
"""


WEIGHT_FORMATS = """
## Weight formats

The transformer's weights in bf16, as GGUF files (loaded by the DiT's `[dit] transformer_file` path, kept quantised,
dequantised per layer as it runs) and in fp8, each timed against bf16 in the same run (`bench/gguf_step.py`; ratio =
bf16 seconds / these seconds). Peak GiB: the step's GPU peak less what the bench held besides these weights (as if
they were alone on the GPU); load s: the seconds to have them on the device (bf16: built; GGUF: checked, loaded and
moved; fp8: converted); host GiB: the process's peak resident size (VmHWM) from the start of this format (GGUF: the
file's writing too); error: relative L2 of one forward's output against the bf16 forward on the same inputs.

| date | measurement | device | dtype | weights | seconds | bf16 seconds | ratio | peak GiB | weights GiB | load s |\
 host GiB (VmHWM) | file GiB | error vs bf16 | software | command |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
"""


FAULT_WALKS = """
## Fault walks

`h3serve up` with the shipped supervision defaults, jobs acknowledged, then one process SIGKILLed at its moment
(`bench/fault_walk.py`): how the acknowledged jobs ended (lost: the gateway no longer knows the job; unfinished: not
ended within the walk's limit), the attempts they used (`Job.attempts` summed), seconds from each kill to the victim
SERVING again, and from the last kill to the last job's end; after a kill of the fp8 save, what the cache held once the
restarted DiT had saved again and how that DiT got its weights.

| date | walk | device | dtype | deployment | acknowledged | succeeded | failed | lost | unfinished | attempts |\
 kill to SERVING s | kill to last job s | fp8 cache after | software | command |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
"""
WALK_COUNTS = ("acknowledged", "succeeded", "failed", "lost", "unfinished", "attempts")  # the keys of Record.jobs


def update_results(records: list[Record], results_path: str, markdown_path: str) -> None:
    """Replace records with the same key, keep the rest, rewrite both files."""
    path = Path(results_path)
    existing = [Record(**r) for r in json.loads(path.read_text())] if path.exists() else []
    fresh = {r.key() for r in records}
    merged = [r for r in existing if r.key() not in fresh] + records
    path.write_text(json.dumps([asdict(r) for r in merged], indent=1) + "\n")
    rows = "".join(
        f"| {r.date} | {r.name} | {r.device} | {r.dtype} | {r.variant} | {r.seconds:.4f} | {r.baseline} | "
        f"{r.baseline_seconds:.4f} | {r.ratio:.3f} | {_peak(r)} | {_host(r)} | {_rate(r)} | {accuracy(r)} | "
        f"{r.software} | `{r.command}` |\n"
        for r in merged
        if r.weights_gib is None and r.jobs is None
    )
    formats = [r for r in merged if r.weights_gib is not None]
    walks = [r for r in merged if r.jobs is not None]
    Path(markdown_path).write_text(
        HEADER
        + rows
        + (WEIGHT_FORMATS + "".join(map(_format_row, formats)) if formats else "")
        + (FAULT_WALKS + "".join(map(_walk_row, walks)) if walks else "")
    )


def _format_row(r: Record) -> str:
    file = "" if r.file_gib is None else f"{r.file_gib:.1f}"
    error = "" if r.rel_err_bf16 is None else f"{r.rel_err_bf16:.2e}"
    return (
        f"| {r.date} | {r.name} | {r.device} | {r.dtype} | {r.variant} | {r.seconds:.4f} | {r.baseline_seconds:.4f} | "
        f"{r.ratio:.3f} | {r.peak_gib:.1f} | {r.weights_gib:.1f} | {r.load_seconds:.1f} | {r.host_hwm_gib:.1f} | "
        f"{file} | {error} | {r.software} | `{r.command}` |\n"
    )


def _walk_row(r: Record) -> str:
    assert r.jobs is not None and r.back_seconds is not None  # a fault walk's record
    counts = " | ".join(str(r.jobs[key]) for key in WALK_COUNTS)
    back = ", ".join("not back" if s is None else f"{s:.1f}" for s in r.back_seconds)
    return (
        f"| {r.date} | {r.name} | {r.device} | {r.dtype} | {r.variant} | {counts} | {back} | {r.seconds:.1f} | "
        f"{r.fp8_cache_after or ''} | {r.software} | `{r.command}` |\n"
    )


def _peak(record: Record) -> str:
    if record.process_peaks_gib:
        return f"{record.peak_gib:.1f} (each at its most: {summed(record.process_peaks_gib, 1)})"
    if len(record.rank_peaks_gib) > 1:
        return f"{record.peak_gib:.1f} (per rank {' / '.join(f'{p:.1f}' for p in record.rank_peaks_gib)})"
    return f"{record.peak_gib:.1f}"


def summed(peaks: dict[str, float], digits: int) -> str:
    """Named figures and their sum: "encoder 3.3 + vae 12.2 = 15.5"."""
    return (
        " + ".join(f"{name} {value:.{digits}f}" for name, value in peaks.items())
        + f" = {sum(peaks.values()):.{digits}f}"
    )


def _host(record: Record) -> str:
    if record.host_peak_gib is None:
        return ""
    if record.host_file_gib is None or record.host_used_gib is None:  # one process's own peak, sampled alone
        return f"{record.host_peak_gib:.1f}"
    return f"{record.host_peak_gib:.1f} (+{record.host_file_gib:.1f}; system +{record.host_used_gib:.1f})"


def _rate(record: Record) -> str:
    if record.tflops is None:
        return ""
    return f"{record.tflops:.0f} ({100 * record.tflops / record.ceiling_tflops:.0f} % of {record.ceiling_tflops:.0f})"


def accuracy(r: Record) -> str:
    if r.rel_err_fp32 is None:
        return "" if r.rel_err_bf16 is None else f"{r.rel_err_bf16:.2e} vs bf16"
    text = f"{r.rel_err_fp32:.2e}"
    if r.bf16_rel_err_fp32 is not None:  # a bench that measured bf16 against fp32 too says so beside it
        text += f" ({r.bf16_rel_err_fp32:.2e})"
    return text if r.rel_err_bf16 is None else f"{text}; {r.rel_err_bf16:.2e} vs bf16"


def add_output_arguments(parser) -> None:
    """--write, --results, --markdown: whether and where a bench records its measurements."""
    parser.add_argument("--write", action="store_true", help="update bench/results.json and BENCHMARKS.md")
    parser.add_argument("--results", default="bench/results.json")
    parser.add_argument("--markdown", default="BENCHMARKS.md")


SETTINGS = ("H3SERVE_SAGE_TARGET",)  # environment variables that change what a bench measures


def command_line(module: str, argv: list[str] | None) -> str:
    """The command a record names, so that anyone can make it again (with the settings it ran under)."""
    settings = [f"{name}={os.environ[name]}" for name in SETTINGS if os.environ.get(name)]
    return " ".join([*settings, f"python -m {module}", *(sys.argv[1:] if argv is None else argv)])
