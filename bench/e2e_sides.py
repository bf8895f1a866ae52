"""What the end-to-end bench (bench/e2e.py) measures of each side, the comparison of the two, and the in-process
baseline a `--side in-process` call saves for the `--side services` calls after it."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from bench.common import HostPeak, Size
from bench.in_process_offload import DEFAULT_MARGIN
from bench.media_diff import FramesDiff, MediaDiff

STAGES = ("encode", "denoise", "decode", "mux")


@dataclass(frozen=True)
class Run:
    """One request: seconds at the client (or around the pipeline), its stages, the MP4's sha256."""

    seconds: float
    stages: dict[str, float]
    digest: str

    @property
    def transport(self) -> float:
        return self.seconds - sum(self.stages.get(s, 0.0) for s in STAGES)


@dataclass(frozen=True)
class Side:
    """The median over repeats of one side at one size, and its device memory: in process, in use after its runs;
    through the services, the most in use while they ran (all processes, sampled), where nvidia-smi is. Host
    memory: the most its processes held from their start to the last request (sampled, bench/common.py host_peak)."""

    seconds: float
    stages: dict[str, float]
    transport: float
    digest: str
    used_gib: float  # on the fullest GPU the side used
    rank_peaks_gib: list[float] = field(default_factory=list)  # services: each DiT rank's peak, last request
    ready_s: float = 0.0  # start to ready: the pipeline loaded / the services healthy (SERVING)
    first_s: float = 0.0  # --warm-start: the first request after SERVING, with no warm-up request
    host_peak_gib: float = 0.0  # private host memory (RssAnon + RssShmem), all the side's processes together
    host_file_gib: float = 0.0  # mapped file pages (RssFile): page cache, reclaimable
    host_used_gib: float = 0.0  # the system's used memory (MemTotal - MemAvailable) over its value at the start
    process_peaks_gib: dict[str, float] = field(default_factory=dict)  # services: each process's own GPU peak

    @classmethod
    def of(
        cls,
        runs: list[Run],
        used_gib: float,
        rank_peaks_gib: list[float] | None = None,
        ready_s: float = 0.0,
        first_s: float = 0.0,
    ) -> Side:
        stages = {s: statistics.median(r.stages.get(s, 0.0) for r in runs) for s in STAGES}
        return cls(
            statistics.median(r.seconds for r in runs),
            stages,
            statistics.median(r.transport for r in runs),
            runs[-1].digest,
            used_gib,
            rank_peaks_gib or [],
            ready_s,
            first_s,
        )

    def with_host(self, host: HostPeak) -> Side:
        return replace(
            self,
            host_peak_gib=round(host.private_gib, 2),
            host_file_gib=round(host.file_gib, 2),
            host_used_gib=round(host.used_gib, 2),
        )

    def host_text(self) -> str:
        """Its host peaks as the table prints them; "" for a side saved before they were sampled."""
        if not self.host_peak_gib:
            return ""
        return HostPeak(self.host_peak_gib, self.host_file_gib, self.host_used_gib).describe()


@dataclass(frozen=True)
class Comparison:
    size: Size
    in_process: Side
    served: Side
    media: MediaDiff  # the two MP4s decoded (zero when they are the same bytes)
    frames: FramesDiff  # the two sides' decoded frames and waveform before the muxer (the last requests)

    @property
    def same_output(self) -> bool:
        return self.in_process.digest == self.served.digest

    @classmethod
    def of(
        cls, size: Size, in_process: Side, served: Side, videos: tuple[Path, Path], raw: tuple[Path, Path]
    ) -> Comparison:
        same = in_process.digest == served.digest
        return cls(size, in_process, served, MediaDiff(0, 0.0) if same else MediaDiff.of(*videos), FramesDiff.of(*raw))


def stage_text(run: Run | Side) -> str:
    stages = ", ".join(f"{stage} {run.stages.get(stage, 0.0):.2f} s" for stage in STAGES)
    return f"{stages}, transport {run.transport:.2f} s"


BEFORE_OPTIONS = {"in_process_offload": "none", "offload_margin": DEFAULT_MARGIN}  # a baseline saved before them


def setup(args) -> dict:
    """What a saved baseline must share with the services run it is compared with."""
    return {
        "sizes": args.sizes,
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "dtype": args.dtype,
        "model_dir": args.model_dir,
        "adapter_rank": args.adapter_rank,
        "flow_shift": args.flow_shift,
        "in_process_offload": args.in_process_offload,
        "offload_margin": args.offload_margin,
    }


def same_setup(saved: dict, args) -> bool:
    """Whether a saved baseline's setup is this run's: a subset of its sizes may be compared, warm-ups are untimed."""
    unchecked = {"sizes": None, "warmup_steps": None}
    return {**BEFORE_OPTIONS, **saved, **unchecked} == {**setup(args), **unchecked}


def save_baseline(path: Path, args, sides: dict[Size, Side]) -> None:
    """Save the in-process medians; a file of the same setup measured at other sizes keeps those (one call per size
    where a 10-minute call holds one size's load and runs, not both)."""
    saved = {"sides": {}, "command": ""}
    if path.exists():
        earlier = json.loads(path.read_text())
        if same_setup(earlier["setup"], args):
            saved = earlier
    kept = {size: side for size, side in saved["sides"].items() if size not in {str(s) for s in sides}}
    merged = {**kept, **{str(size): asdict(side) for size, side in sides.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {
                "setup": {**setup(args), "sizes": ",".join(merged)},
                "command": "; ".join(filter(None, [saved["command"] if kept else "", args.command])),
                "sides": merged,
            },
            indent=1,
        )
    )


def load_baseline(path: Path, args) -> tuple[dict[Size, Side], str]:
    """The in-process medians a `--side in-process` run saved, and its command; refused for another setup."""
    if not path.exists():
        raise SystemExit(f"--side services: no baseline at {path}; run with --side in-process first")
    saved = json.loads(path.read_text())
    saved["setup"] = {**BEFORE_OPTIONS, **saved["setup"]}
    if saved["setup"]["in_process_offload"] != args.in_process_offload:
        raise SystemExit(
            f"--side services: the baseline in {path} ran diffusers in process with --in-process-offload "
            f"{saved['setup']['in_process_offload']}, this run names {args.in_process_offload}: give the same, or "
            "run --side in-process again"
        )
    missing = set(args.sizes.split(",")) - set(saved["sides"])
    if not same_setup(saved["setup"], args) or missing:
        raise SystemExit(
            f"--side services: the baseline in {path} was measured with {saved['setup']}, this run is {setup(args)}"
        )
    return {Size.parse(size): Side(**side) for size, side in saved["sides"].items()}, saved["command"]


def baseline_output(baseline_file: Path, size: Size, suffix: str) -> Path:
    """Where a `--side in-process` call keeps its MP4 (.mp4) and raw output (.npz) for the `--side services`
    calls that compare with it."""
    return baseline_file.with_name(f"{baseline_file.stem}-{size}{suffix}")


def print_table(comparisons: list[Comparison], in_process: str = "in process") -> None:
    """The sides' medians per size; `in_process` labels the baseline's rows (which offload it ran with)."""
    print(
        f"{'size':16} {'':12} {'e2e s':>8} "
        + " ".join(f"{s:>8}" for s in (*STAGES, "transport"))
        + f" {'GiB used':>9}  host memory at most"
    )
    for c in comparisons:
        for label, side in ((in_process, c.in_process), ("services", c.served)):
            print(
                f"{str(c.size):16} {label:12} {side.seconds:8.3f} "
                + " ".join(f"{side.stages[s]:8.3f}" for s in STAGES)
                + f" {side.transport:8.3f}"
                + f" {side.used_gib:9.2f}  {side.host_text()}"
            )
        print(
            f"{'':16} {'ratio':12} {c.in_process.seconds / c.served.seconds:8.4f}  "
            f"(in process / services; same MP4: {c.same_output}; {c.media.describe()}; {c.frames.describe()})"
        )
        if c.served.first_s:
            print(
                f"{'':16} {'first':12} {c.served.first_s:8.3f}  (the first request after SERVING: "
                f"{c.served.first_s / c.served.seconds:.3f}x the median; start to SERVING {c.served.ready_s:.1f} s, "
                f"pipeline load in process {c.in_process.ready_s:.1f} s)"
            )
