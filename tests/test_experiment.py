"""`h3serve experiment`: a sweep over two real deployments of the tiny model (the VAE on one replica, then two),
its raw data checked against the gateway's own job records, the report re-rendered, the capacity model's
prediction of one configuration from the other's run, and every refusal of the load and sweep files."""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from deployments import write_config

from h3serve.cli.experiment import add_parser
from h3serve.cli.launcher import ServiceGroup, is_answering
from h3serve.client import GatewayClient
from h3serve.common.config import ConfigError, load_deploy
from h3serve.common.free_ports import free_port
from h3serve.common.processes import descendants
from h3serve.experiment.analysis import Run
from h3serve.experiment.loadspec import load_spec
from h3serve.experiment.model import JobClass, Load, Profile, simulate, speeds
from h3serve.experiment.records import Records, job_row, stage_rows
from h3serve.experiment.sweep import check_sweep
from h3serve.experiment.workload import JobKind

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[1]
# Tiny jobs, an open loop at about half the one-VAE capacity of the 2-core machine (a VAE pass takes ~0.6 s):
# the VAE's queue matters with one replica and hardly with two.
LOAD = """
seed = 11
warmup = 1
[arrivals]
process = "poisson"
rate = 0.8
[bounds]
max_jobs = {jobs}
max_seconds = 300
[[mix]]
workflow = "t2va"
weight = {t2va_weight}
height = 32
width = 64
steps = 4
[[mix]]
workflow = "fl2va"
height = 32
width = 64
steps = 4
[[mix]]
workflow = "ref2va"
height = 32
width = 64
steps = 4
"""
JOBS = 80  # the timing tier's sweep: enough jobs of the weighted mix (t2va 8 : 1 : 1) for a p95
# The suite's sweep: its checks (the records, the report, the overlay) need every workflow on both configurations,
# not a distribution; with equal weights the load's seed draws all three within these jobs.
REPORT_JOBS = 6
# The model's p50 / p95 against the measured other configuration. Quiet fresh-clone runs on the 2-core CI-like
# machine measured p50 -2.7 % .. +14.9 %, p95 +0.7 % .. +16.4 %; a model without the queueing it predicts is off
# by far more (every job would wait for no VAE call).
TOLERANCE = 0.25
# A run on a shared 2-core machine is as noisy as the other work beside it (docs/experiments.md: the same
# configuration measured p95 0.73 s and 2.63 s): the model is compared with the runs only when each had the CPUs to
# itself, other work using at most this many cores on average.
QUIET_CORES = 0.1
# Keyframes and references stay small (the released 2048 px short edge takes seconds per image on CPU).
GEOMETRY = {"canvas_short_edge": 64, "canvas_max_pixels": 8192, "reference_image_short_edge": 32}


def experiment(*argv: str) -> None:
    """`h3serve experiment ...` in this process, as h3serve/cli/main.py wires it."""
    root = argparse.ArgumentParser(prog="h3serve")
    add_parser(root.add_subparsers(dest="command", required=True))
    args = root.parse_args(["experiment", *argv])
    args.run(args)


def deployment(root: Path, name: str, model_dir: Path, vae_replicas: int) -> Path:
    ports = {service: free_port() for service in ("encoder", "dit", "vae", "gateway", "metrics")}
    vae = [f"127.0.0.1:{ports['vae']}", *(f"127.0.0.1:{free_port()}" for _ in range(vae_replicas - 1))]
    return write_config(
        root / f"{name}.toml",
        str(model_dir),
        root / name,
        ports,
        model=GEOMETRY,
        service_keys={"threads": 1},
        metrics_port=ports["metrics"],
        vae=vae,
    )


def machine_busy_s() -> float:
    """Busy seconds of all the machine's CPUs since boot."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and its live descendants (the stacks), each with its ended children's."""
    total = 0
    for pid in (os.getpid(), *descendants(os.getpid())):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile: its time is its parent's now
            continue
        total += sum(int(value) for value in fields[11:15])  # utime, stime, cutime, cstime
    return total / os.sysconf("SC_CLK_TCK")


class OtherWork:
    """Samples every second the CPU the machine spends outside this test's process tree, in cores."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []  # (unix time, cores)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        last = (time.time(), machine_busy_s(), own_cpu_s())
        while not self._stop.wait(1.0):
            now = (time.time(), machine_busy_s(), own_cpu_s())
            self.samples.append((now[0], max(0.0, (now[1] - last[1]) - (now[2] - last[2])) / (now[0] - last[0])))
            last = now

    def __enter__(self) -> OtherWork:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def cores(self, start: float, end: float) -> float:
        return float(np.mean([cores for at, cores in self.samples if start <= at <= end] or [0.0]))


@dataclass(frozen=True)
class Sweep:
    root: Path
    other_cores: dict[str, float]  # per configuration: CPU other work used during its run, cores on average


def run_sweep(root: Path, model_dir: Path, jobs: int, t2va_weight: int) -> Sweep:
    """`h3serve experiment run --sweep`: each configuration started (its extra VAE replica too), measured under
    the same load, stopped."""
    (root / "load.toml").write_text(LOAD.format(jobs=jobs, t2va_weight=t2va_weight))
    configs = {name: deployment(root, name, model_dir, replicas) for name, replicas in (("vae-1", 1), ("vae-2", 2))}
    (root / "sweep.toml").write_text(
        'load = "load.toml"\n'
        + "".join(f'[[config]]\nname = "{name}"\ndeploy = "{path.name}"\n' for name, path in configs.items())
    )
    with OtherWork() as other:
        experiment("run", "--sweep", str(root / "sweep.toml"), "--out", str(root / "out"), "--quiet")
    runs = {name: json.loads((root / "out" / name / "run.json").read_text()) for name in configs}
    return Sweep(root, {name: other.cores(run["started"], run["ended"]) for name, run in runs.items()})


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, tiny_model_dir) -> Sweep:
    return run_sweep(tmp_path_factory.mktemp("experiment"), tiny_model_dir, REPORT_JOBS, t2va_weight=1)


@pytest.fixture(scope="module")
def timed_sweep(tmp_path_factory, tiny_model_dir) -> Sweep:
    return run_sweep(tmp_path_factory.mktemp("timed-experiment"), tiny_model_dir, JOBS, t2va_weight=8)


def gateway_records(root: Path, name: str) -> ServiceGroup:
    """A gateway alone on the configuration's kept data directory: its job records as the API serves them."""
    config = root / f"{name}.toml"
    return ServiceGroup(
        load_deploy(config),
        str(config),
        str(root / "readback"),
        names=("gateway",),
        ready=is_answering,
        flags={"gateway": ["--data-dir", str(root / "out" / name / "gateway-data")]},
    )


@pytest.mark.parametrize("name", ["vae-1", "vae-2"])
def test_the_report_holds_exactly_the_gateways_job_records(sweep, name):
    folder = sweep.root / "out" / name
    for file in (
        "jobs.csv",
        "stage_records.csv",
        "steps.csv",
        "metrics.json",
        "summary.json",
        "run.json",
        "report.html",
        *(
            f"{figure}.png"
            for figure in ("utilisation", "queue_depth", "latency_cdf", "throughput", "timeline", "dit_steps")
        ),
    ):
        assert (folder / file).stat().st_size > 0, file
    recorded = Records.read(folder)
    assert len(recorded.jobs) == REPORT_JOBS and all(job.done for job in recorded.jobs)
    assert {job.workflow for job in recorded.jobs} == {"t2va", "fl2va", "ref2va"}
    config = load_deploy(sweep.root / f"{name}.toml")
    with gateway_records(sweep.root, name), GatewayClient(f"127.0.0.1:{config.gateway.port}") as client:
        jobs = [client.job(job.job_id) for job in recorded.jobs]
    assert recorded.jobs == [
        job_row(job, row.index, row.arrival_s, row.submitted) for job, row in zip(jobs, recorded.jobs, strict=True)
    ]
    assert recorded.stages == [row for job in jobs for row in stage_rows(job)]
    vae = {record.replica for job in jobs for record in job.stage_records if record.stage == "vae"}
    assert len(vae) == len(config.gateway.replicas("vae")), "every VAE replica took jobs"
    for job in jobs:  # N steps are N-1 denoise steps, each one event
        assert len([s for s in recorded.steps if s.job_id == job.job_id]) == job.request.params.num_inference_steps - 1

    summary = json.loads((folder / "summary.json").read_text())
    latencies = [job.updated - job.created for job in jobs]
    assert summary["latency_s"]["all"]["p50"] == float(np.percentile(latencies, 50))
    assert summary["latency_s"]["all"]["p95"] == float(np.percentile(latencies, 95))
    span = max(job.updated for job in jobs) - min(job.created for job in jobs)
    assert summary["throughput_per_s"] == REPORT_JOBS / span
    dit = [r.finished - r.started for job in jobs for r in job.stage_records if r.stage == "dit"]
    assert summary["stages"]["dit"]["service_s"]["mean"] == float(np.mean(dit))
    assert summary["stages"]["vae"]["replicas"] == len(vae)

    scraped = json.loads((folder / "metrics.json").read_text())["scrapes"]
    assert scraped[-1]["series"]['h3serve_jobs{state="succeeded"}'] >= REPORT_JOBS  # warm-up jobs count too
    page = (folder / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 6 and 'src="http' not in page
    before = (folder / "summary.json").read_text()
    experiment("report", str(folder))
    assert (folder / "summary.json").read_text() == before


def test_the_sweep_overlays_both_configurations(sweep):
    page = (sweep.root / "out" / "report.html").read_text()
    assert "vae-1" in page and "vae-2" in page and page.count("data:image/png;base64,") == 1
    assert (sweep.root / "out" / "overlay.png").stat().st_size > 0


def prediction_errors(measured_from: Path, predicted: Path) -> dict[str, float]:
    target = Run.read(predicted)
    replicas = {service: target.replicas(service) for service in ("encoder", "dit", "vae")}
    prediction = simulate(Profile.measure(Run.read(measured_from)), replicas, Load())
    measured = json.loads((predicted / "summary.json").read_text())["latency_s"]["all"]
    return {q: prediction.latency_s[q] / measured[q] - 1 for q in ("p50", "p95")}


@pytest.mark.timing
def test_the_model_predicts_one_vae_from_the_run_on_two(timed_sweep):
    """The run on two VAE replicas measured how much two calls at once slow each other on this machine; the
    model, fed that run alone, predicts the one-replica run (the same arrivals) within the tolerance."""
    out = timed_sweep.root / "out"
    errors = prediction_errors(out / "vae-2", out / "vae-1")
    reverse = prediction_errors(out / "vae-1", out / "vae-2")
    print(
        f"\nmodel error, vae-2 run -> vae-1: {errors}; vae-1 run -> vae-2 (no speed measured at 2): {reverse}; "
        f"other work on the machine during the runs, cores: {timed_sweep.other_cores}"
    )
    if max(timed_sweep.other_cores.values()) > QUIET_CORES:
        pytest.skip(
            f"not compared: other work used {max(timed_sweep.other_cores.values()):.2f} cores during a run "
            f"(errors p50 {errors['p50']:+.1%}, p95 {errors['p95']:+.1%})"
        )
    assert all(abs(error) <= TOLERANCE for error in errors.values()), errors


# The load and sweep files: every refusal names the file and the key.

GOOD = {
    "arrivals": 'process = "poisson"\nrate = 1.0',
    "bounds": "max_jobs = 2",
    "mix": 'workflow = "t2va"\nheight = 32\nwidth = 64\nsteps = 4',
}


def load_text(
    top: str = "", arrivals: str | None = None, bounds: str | None = None, mix: str | None = None, extra: str = ""
) -> str:
    sections = [top]
    for name, body, table in (
        ("arrivals", arrivals, "[arrivals]"),
        ("bounds", bounds, "[bounds]"),
        ("mix", mix, "[[mix]]"),
    ):
        body = GOOD[name] if body is None else body
        if body != "-":
            sections.append(f"{table}\n{body}")
    return "\n".join(sections + [extra]) + "\n"


CASES = {
    "not TOML": ("seed = \n", "Invalid value"),
    "unknown key": (load_text("speed = 1"), "speed: unknown key"),
    "negative seed": (load_text("seed = -1"), "seed: Input should be greater than or equal to 0"),
    "negative warm-up": (load_text("warmup = -1"), "warmup: Input should be greater than or equal to 0"),
    "no arrivals": (load_text(arrivals="-"), "arrivals: required"),
    "unknown process": (load_text(arrivals='process = "bursty"'), "arrivals.process: Input should be 'poisson'"),
    "poisson without a rate": (load_text(arrivals='process = "poisson"'), "process 'poisson' needs rate"),
    "two parameters": (
        load_text(arrivals='process = "poisson"\nrate = 1.0\nconcurrency = 2'),
        "process 'poisson' takes rate only, not concurrency",
    ),
    "rate 0": (load_text(arrivals='process = "poisson"\nrate = 0'), "arrivals.rate: Input should be greater than 0"),
    "rate as text": (load_text(arrivals='process = "poisson"\nrate = "1"'), "arrivals.rate: Input should be a valid"),
    "closed without clients": (load_text(arrivals='process = "closed"'), "process 'closed' needs concurrency"),
    "closed, 0 clients": (
        load_text(arrivals='process = "closed"\nconcurrency = 0'),
        "arrivals.concurrency: Input should be greater than 0",
    ),
    "trace without a file": (load_text(arrivals='process = "trace"'), "process 'trace' needs trace"),
    "trace missing": (load_text(arrivals='process = "trace"\ntrace = "none.txt"'), "arrivals.trace: no such file"),
    "unbounded": (load_text(bounds=""), "bounds: give max_jobs, max_seconds or both"),
    "no jobs": (load_text(bounds="max_jobs = 0"), "bounds.max_jobs: Input should be greater than 0"),
    "no time": (load_text(bounds="max_seconds = -1"), "bounds.max_seconds: Input should be greater than 0"),
    "no drain": (load_text(bounds="max_jobs = 1\ndrain_s = 0"), "bounds.drain_s: Input should be greater than 0"),
    "no mix": (load_text(mix="-"), "mix: required"),
    "empty mix": (load_text("mix = []", mix="-"), "mix: at least one [[mix]] entry is required"),
    "unknown workflow": (load_text(mix='workflow = "i2v"'), "mix.0.workflow: Input should be 't2va'"),
    "unknown mix key": (load_text(mix='workflow = "t2va"\ncanvas = "32x64"'), "mix.0.canvas: unknown key"),
    "weight 0": (load_text(mix='workflow = "t2va"\nweight = 0'), "mix.0.weight: Input should be greater than 0"),
    "odd canvas": (
        load_text(mix='workflow = "t2va"\nheight = 40\nwidth = 64'),
        "mix.0.height: must be a multiple of 32, got 40",
    ),
    "height alone": (load_text(mix='workflow = "t2va"\nheight = 32'), "height and width go together"),
    "frames": (load_text(mix='workflow = "t2va"\nnum_frames = 125'), "mix.0.num_frames: must be 17n+5 in 124..345"),
    "one step": (load_text(mix='workflow = "t2va"\nsteps = 1'), "mix.0.steps: must be at least 2"),
    "steps as text": (load_text(mix='workflow = "t2va"\nsteps = "4"'), "mix.0.steps: Input should be a valid integer"),
    "empty prompt": (load_text(mix='workflow = "t2va"\nprompt = ""'), "mix.0.prompt: String should have at least 1"),
    "t2va with a keyframe": (
        load_text(mix='workflow = "t2va"\nfirst_frame = "key.png"'),
        "a t2va job takes no first_frame",
    ),
    "fl2va with references": (
        load_text(mix='workflow = "fl2va"\nreferences = ["key.png"]'),
        "a fl2va job takes no references",
    ),
    "keyframe missing": (load_text(mix='workflow = "fl2va"\nlast_frame = "gone.png"'), "mix.0.last_frame: no such"),
    "media missing": (
        load_text(mix='workflow = "ref2va"\nreferences = ["gone.wav"]'),
        "mix.0.references: no such file",
    ),
    "adapters": (
        load_text(mix='workflow = "t2va"\nadapters = ["style:strong"]'),
        "mix.0.adapters: NAME[:WEIGHT] with a number as the weight, got 'style:strong'",
    ),
    "scrape period": (load_text(extra="[metrics]\nscrape_s = 0"), "metrics.scrape_s: Input should be greater than 0"),
}
TRACES = {
    "a word": ("0\nsoon\n", "line 2: not a number: 'soon'"),
    "backwards": ("0\n2\n1\n", "line 3: arrival times must be"),
    "negative": ("-1\n", "line 1: arrival times must be"),
    "empty": ("# nothing\n", "no arrival times"),
}


@pytest.mark.parametrize("case", CASES)
def test_every_load_file_problem_is_refused_by_name(tmp_path, case):
    text, message = CASES[case]
    (tmp_path / "key.png").write_bytes(b"")
    path = tmp_path / "load.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="^" + str(path)) as refused:
        load_spec(path)
    assert message in str(refused.value)


@pytest.mark.parametrize("case", TRACES)
def test_every_trace_problem_is_refused_with_its_line(tmp_path, case):
    trace, message = TRACES[case]
    (tmp_path / "arrivals.txt").write_text(trace)
    path = tmp_path / "load.toml"
    path.write_text(load_text(arrivals='process = "trace"\ntrace = "arrivals.txt"'))
    with pytest.raises(ConfigError, match=r"arrivals: .*arrivals.txt") as refused:
        load_spec(path)
    assert message in str(refused.value)


def test_a_mix_entry_sends_its_adapters(tmp_path):
    path = tmp_path / "load.toml"
    path.write_text(load_text(mix='workflow = "t2va"\nadapters = ["turbo4:0.5", "style"]'))
    request = JobKind(load_spec(path).mix[0]).request(3, "job-3")
    assert [(a.name, a.weight) for a in request.params.adapters] == [("turbo4", 0.5), ("style", 0.0)]
    assert (request.params.seed, request.request_id) == (3, "job-3")


def test_a_missing_load_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="No such file"):
        load_spec(tmp_path / "absent.toml")


SWEEPS = {
    "no configuration": ('load = "load.toml"\nconfig = []', "at least one [[config]] is required"),
    "same names": (
        'load = "load.toml"\n' + '[[config]]\nname = "a"\ndeploy = "deploy.toml"\n' * 2,
        "config names must differ: a, a",
    ),
    "no load": ('[[config]]\nname = "a"\ndeploy = "deploy.toml"', "give a load"),
    "bad name": (
        'load = "load.toml"\n[[config]]\nname = "a/b"\ndeploy = "deploy.toml"',
        "config.0.name: String should match pattern",
    ),
    "load missing": ('[[config]]\nname = "a"\ndeploy = "deploy.toml"\nload = "gone.toml"', "config.0.load: no such"),
    "deploy missing": ('load = "load.toml"\n[[config]]\nname = "a"\ndeploy = "gone.toml"', "config.0.deploy: no such"),
    "gpus per replica": (
        'load = "load.toml"\n[[config]]\nname = "a"\ndeploy = "deploy.toml"\n[config.gpus]\nvae = ["0", "1"]',
        "config a gpus.vae: 2 entries for 1 replicas",
    ),
    "unknown service": (
        'load = "load.toml"\n[[config]]\nname = "a"\ndeploy = "deploy.toml"\n[config.gpus]\ngateway = ["0"]',
        "config.0.gpus.gateway: Input should be 'encoder'",
    ),
}


@pytest.mark.parametrize("case", SWEEPS)
def test_every_sweep_file_problem_is_refused_by_name(tmp_path, case):
    text, message = SWEEPS[case]
    (tmp_path / "load.toml").write_text(load_text())
    (tmp_path / "deploy.toml").write_text("[gateway]\nport = 50050\n")
    path = tmp_path / "sweep.toml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError) as refused:
        check_sweep(path)
    assert message in str(refused.value)


def test_the_documented_example_files_are_valid():
    checks = {"config": check_sweep, "arrivals": load_spec}  # by a key only that kind of file has; else a deployment
    for path in sorted((ROOT / "docs" / "experiments").glob("*.toml")):
        keys = tomllib.loads(path.read_text())
        next((check for key, check in checks.items() if key in keys), load_deploy)(path)


# The model's mechanics against queueing theory and a known slow-down, on profiles made here.


def profile(
    work_s: list[float],
    replicas: int = 1,
    speeds: tuple[float, ...] = (1.0,),
    clients: int | None = None,
    rate: float = 1.0,
) -> Profile:
    """One job class whose only stage is the DiT (the encoder and VAE take no time), no overhead."""
    job = JobClass(
        "t2va", (("encoder",), ("dit",), ("vae",)), {"encoder": (0.0,), "dit": tuple(work_s), "vae": (0.0,)}, (0.0,)
    )
    return Profile(
        "made",
        {"t2va": job},
        tuple((i / rate, "t2va") for i in range(100)),
        {"encoder": 1, "dit": replicas, "vae": 1},
        clients,
        {"dit": speeds},
    )


def test_the_model_matches_an_m_d_1_queue():
    """Poisson arrivals at 0.5/s, 1 s of work each, one replica: mean latency 1 + rho / (2 mu (1 - rho)) = 1.5 s."""
    made = profile([1.0])
    prediction = simulate(made, made.replicas, Load(rate=0.5), jobs=2000, runs=5)
    assert prediction.latency_s["mean"] == pytest.approx(1.5, rel=0.05)
    assert prediction.utilisation["dit"] == pytest.approx(0.5, rel=0.05)
    assert (prediction.max_rate, prediction.bottleneck) == (1.0, "dit")


def test_replicas_that_share_a_machine_run_at_the_measured_speed():
    """Two clients, two replicas that each run at half speed when both work: every job takes 2 s, 1 job/s."""
    made = profile([1.0], replicas=2, speeds=(1.0, 0.5), clients=2)
    prediction = simulate(made, made.replicas, Load(), runs=3)
    assert prediction.latency_s["p50"] == pytest.approx(2.0) and prediction.throughput_per_s == pytest.approx(1.0)
    assert prediction.max_rate == pytest.approx(1.0) and not prediction.unmeasured
    assert simulate(made, {**made.replicas, "dit": 3}, Load(), runs=1).unmeasured == [
        "dit: speed with up to 3 calls at once taken as with 2 (measured up to 2)"
    ]


def test_the_speeds_are_recovered_from_overlapping_passes():
    """Passes of known work (0.5..1.5 s) that shared the stage for a random part of their time at speed 0.6."""
    rng = np.random.default_rng(0)
    work, shared_fraction = rng.uniform(0.5, 1.5, 400), rng.uniform(0.0, 1.0, 400)
    alone = work * (1 - shared_fraction)  # seconds at speed 1
    together = work * shared_fraction / 0.6  # seconds at speed 0.6 for the same work
    measured = speeds([np.array([a, t]) for a, t in zip(alone, together, strict=True)], ["t2va"] * 400)
    assert measured[0] == 1.0 and measured[1] == pytest.approx(0.6, rel=0.02)
