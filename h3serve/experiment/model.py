"""The capacity model: a discrete-event simulation (simpy) of the gateway's stages, fed with a measured run.

What it simulates is what the gateway does (docs/architecture.md): each stage is a FIFO queue in front of as
many workers as its service has replicas (`StageQueue`; vae-encode runs on the vae replicas, with a queue of its
own); a job walks its workflow's plan (h3serve.model.workflows), the stages of one step at the same time. Each
pass holds one worker for as long as its work takes, the work drawn from the measured passes of the same stage and
job class (workflow, canvas, frames, steps: the empirical distribution, resampled), and each job adds a measured
overhead (its latency less the time it spent in the plan's steps: admission, hand-offs, writing the artifact).

Replicas that share a machine slow one another down: on the 2-core CPU stack two VAE calls at once each run at
about half speed; on GPUs, one replica per card, hardly at all. So a stage has a speed per number of its calls
running at once (speed 1 for one alone), measured from the run (`speeds`), and a pass's work is its measured time
with the time it shared the stage counted at that speed. A pass simulated alongside k-1 others progresses at the
speed of k. Counts beyond what the run measured (more replicas than it had) take the speed of the highest count
it saw, and the prediction says so (`Prediction.unmeasured`): a run on one replica says nothing about two.

Open-loop runs are modelled open (the measured arrivals replayed, or Poisson at another rate), closed-loop runs
closed (the same number of clients, each submitting when its last job ends). A prediction pools the latencies of
many replications of the same run length, so it carries the same start-up transient as a measured run.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import simpy

from h3serve.experiment.analysis import QUANTILES, SERVICE_OF, STAGES, Run, occupancy, summarise, time_at_levels
from h3serve.model.workflows import by_name

SERVICES = ("encoder", "dit", "vae")
MIN_SHARED_PASSES = 5  # passes that spent a quarter of their time with k calls at once, to estimate the speed at k
DONE_S = 1e-9  # work left below this is finished (float rounding of work x speed)


@dataclass(frozen=True)
class JobClass:
    name: str  # records.JobRow.job_class
    plan: tuple[tuple[str, ...], ...]  # the workflow's stages, step by step
    work_s: dict[str, tuple[float, ...]]  # per stage: each measured pass's work (seconds at speed 1)
    overhead_s: tuple[float, ...]  # per job: latency less the time in the plan's steps


def _overhead(run: Run, job, plan) -> float:
    """The job's latency less, step by step, the time from the step's enqueue to its last stage's finish."""
    rows = [r for r in run.records.stages if r.job_id == job.job_id and r.attempt == job.attempts]
    in_steps = sum(
        max(r.finished for r in rows if r.stage in step) - min(r.enqueued for r in rows if r.stage in step)
        for step in plan
    )
    return job.latency_s - in_steps


def _shared_times(run: Run, stage: str) -> dict[tuple[str, int], np.ndarray]:
    """Per finished pass (job id, attempt): the seconds it ran with 1, 2, ... replicas of the stage busy."""
    times, counts = occupancy(run.busy(stage))
    top = run.replicas(stage)
    return {
        (r.job_id, r.attempt): time_at_levels(times, counts, r.started, r.finished, top)
        for r in run.on_replica(stage)
        if r.finished
    }


def speeds(shared: list[np.ndarray], classes: list[str]) -> tuple[float, ...]:
    """The speed of one call when k run at once, k = 1 (1.0), 2, ...: as far as the passes measured it.

    A pass's work is sum_k speed_k x seconds at k. The speeds are those that leave the work uncorrelated with
    the share of each pass's time spent at each k (within a job class): sharing the stage says nothing about
    how much work a pass had, only about how fast it went. One linear equation per k >= 2. A speed is kept
    within 1/k (k calls taking turns) and 1 (no slow-down)."""
    kept = [i for i, row in enumerate(shared) if row.sum() > 0]  # a pass of no measurable length has no shares
    times, group = np.array([shared[i] for i in kept]), np.array([classes[i] for i in kept])
    fractions = times / times.sum(axis=1, keepdims=True) if times.size else times
    levels = []  # the columns of counts 2, 3, ... up to the first one too few passes saw
    for column in range(1, times.shape[1] if times.size else 0):
        if np.sum(fractions[:, column] >= 0.25) < MIN_SHARED_PASSES:
            break
        levels.append(column)
    if not levels:
        return (1.0,)

    def centred(values: np.ndarray) -> np.ndarray:  # within each job class
        out = values.astype(float).copy()
        for name in set(group):
            out[group == name] -= out[group == name].mean(axis=0)
        return out

    f, tau = centred(fractions[:, levels]), centred(times)
    system = f.T @ tau[:, levels]  # sum_j speed_j cov(tau_j, f_k) = -cov(tau_1, f_k)
    solved = np.linalg.solve(system, -(f.T @ tau[:, 0]))
    return (1.0, *(float(np.clip(speed, 1 / (column + 1), 1.0)) for speed, column in zip(solved, levels, strict=True)))


@dataclass(frozen=True)
class Profile:
    """What the model takes from a measured run."""

    label: str
    classes: dict[str, JobClass]
    sequence: tuple[tuple[float, str], ...]  # the run's jobs in arrival order: (arrival s, class name)
    replicas: dict[str, int]  # per service: encoder, dit, vae
    concurrency: int | None  # a closed-loop run's clients; None: open loop
    speeds: dict[str, tuple[float, ...]]  # per stage: speed of a call with k calls at once, k = 1, 2, ...

    @classmethod
    def measure(cls, run: Run) -> Profile:
        done = [job for job in run.records.jobs if job.done]
        if not done:
            raise ValueError(f"{run.folder}: no job succeeded: nothing to model")
        class_of = {job.job_id: job.job_class for job in run.records.jobs}
        shared = {stage: _shared_times(run, stage) for stage in run.stages()}
        stage_speeds = {
            stage: speeds(list(passes.values()), [class_of[job_id] for job_id, _ in passes])
            for stage, passes in shared.items()
        }

        def work(stage: str, job) -> float:
            at_levels = shared[stage][job.job_id, job.attempts]
            rates = stage_speeds[stage] + (stage_speeds[stage][-1],) * (at_levels.size - len(stage_speeds[stage]))
            return float(at_levels @ np.array(rates))

        classes = {}
        for name in sorted({job.job_class for job in done}):
            jobs = [job for job in done if job.job_class == name]
            plan = by_name(jobs[0].workflow).plan
            classes[name] = JobClass(
                name,
                plan,
                {stage: tuple(work(stage, job) for job in jobs) for step in plan for stage in step},
                tuple(_overhead(run, job, plan) for job in jobs),
            )
        arrivals = run.meta["load"]["arrivals"]
        return cls(
            run.label,
            classes,
            tuple((job.arrival_s, job.job_class) for job in sorted(done, key=lambda j: j.arrival_s)),
            {service: run.replicas(service) for service in SERVICES},
            arrivals["concurrency"] if arrivals["process"] == "closed" else None,
            stage_speeds,
        )

    def speed(self, stage: str, running: int) -> float:
        measured = self.speeds.get(stage, (1.0,))
        return measured[min(running, len(measured)) - 1]

    def unmeasured(self, replicas: dict[str, int]) -> list[str]:
        """The stages that may run more calls at once at `replicas` than the run measured a speed for."""
        return [
            f"{stage}: speed with up to {replicas[SERVICE_OF[stage]]} calls at once taken as with "
            f"{len(measured)} (measured up to {len(measured)})"
            for stage, measured in self.speeds.items()
            if replicas[SERVICE_OF[stage]] > len(measured)
        ]

    def shares(self) -> dict[str, float]:
        counts: defaultdict[str, int] = defaultdict(int)
        for _, name in self.sequence:
            counts[name] += 1
        return {name: n / len(self.sequence) for name, n in counts.items()}

    def demand(self, stage: str) -> float:
        """Mean work (seconds at speed 1) one job of the mix asks of `stage`."""
        return sum(
            share * float(np.mean(self.classes[name].work_s.get(stage) or [0.0]))
            for name, share in self.shares().items()
        )

    def max_rate(self, replicas: dict[str, int]) -> tuple[float, str]:
        """The largest sustainable arrival rate, jobs/s: where the busiest stage's utilisation reaches 1, every
        replica working at the speed of all of them busy; and that stage."""
        rates = {
            stage: replicas[SERVICE_OF[stage]] * self.speed(stage, replicas[SERVICE_OF[stage]]) / self.demand(stage)
            for stage in STAGES
            if self.demand(stage)
        }
        stage = min(rates, key=rates.__getitem__)
        return rates[stage], stage


class _Station:
    """One stage: a FIFO queue for its replicas (simpy.Resource) and the calls running on them, each progressing
    at the profile's speed for the number running."""

    def __init__(self, env: simpy.Environment, replicas: int, speed) -> None:
        self.env, self.speed = env, speed
        self.workers = simpy.Resource(env, capacity=replicas)
        self.left: dict[simpy.Event, float] = {}  # running call -> work left
        self.since = 0.0
        self.changed = env.event()
        env.process(self._finish_calls())

    def _advance(self) -> None:
        """Bring the work left up to now, at the speed of the calls running since the last change."""
        if self.left:
            done = (self.env.now - self.since) * self.speed(len(self.left))
            self.left = {call: left - done for call, left in self.left.items()}
        self.since = self.env.now

    def serve(self, work: float):
        """Queue for a replica, then run `work`; yields until it is done. Returns the seconds it held the replica."""
        with self.workers.request() as turn:
            yield turn
            started = self.env.now
            self._advance()
            call = self.env.event()
            self.left[call] = work
            if not self.changed.triggered:  # another call may have started at this same instant
                self.changed.succeed()
            yield call
            return self.env.now - started

    def _finish_calls(self):
        while True:
            self.changed = self.env.event()
            if not self.left:
                yield self.changed
                continue
            first = min(self.left.values()) / self.speed(len(self.left))
            yield self.env.timeout(max(first, 0.0)) | self.changed
            self._advance()
            for call in [call for call, left in self.left.items() if left <= DONE_S]:
                del self.left[call]
                call.succeed()


class _Replication:
    """One simulated run."""

    def __init__(self, profile: Profile, replicas: dict[str, int], rng: random.Random) -> None:
        self.profile, self.rng = profile, rng
        self.env = simpy.Environment()
        self.stations = {
            stage: _Station(
                self.env, replicas[SERVICE_OF[stage]], lambda running, stage=stage: profile.speed(stage, running)
            )
            for stage in STAGES
        }
        self.busy: dict[str, float] = defaultdict(float)
        self.latencies: list[float] = []
        self.start = 0.0

    def _pass(self, stage: str, job: JobClass):
        held = yield self.env.process(self.stations[stage].serve(self.rng.choice(job.work_s[stage])))
        self.busy[stage] += held  # read after the wait: other passes add to it meanwhile

    def _job(self, name: str):
        job, start = self.profile.classes[name], self.env.now
        for step in job.plan:
            yield self.env.all_of([self.env.process(self._pass(stage, job)) for stage in step])
        yield self.env.timeout(self.rng.choice(job.overhead_s))
        self.latencies.append(self.env.now - start)

    def open(self, arrivals: list[tuple[float, str]]) -> None:
        def source():
            for at, name in arrivals:
                yield self.env.timeout(at - self.env.now)
                self.env.process(self._job(name))

        self.env.process(source())
        self.start = arrivals[0][0]

    def closed(self, clients: int, names: list[str]) -> None:
        queue = iter(names)

        def client():
            while (name := next(queue, None)) is not None:
                yield self.env.process(self._job(name))

        for _ in range(clients):
            self.env.process(client())

    def run(self, jobs: int) -> float:
        """Runs until every job has ended (the stations' own processes never end); returns the span (first
        arrival to last end)."""
        while len(self.latencies) < jobs:
            self.env.step()
        return self.env.now - self.start


@dataclass(frozen=True)
class Load:
    """What arrives: Poisson at `rate`, a closed loop of `concurrency` clients, or neither: the measured run's own
    arrivals (replayed) or clients."""

    rate: float | None = None
    concurrency: int | None = None

    def describe(self, profile: Profile) -> str:
        if self.rate:
            return f"Poisson at {self.rate:g} jobs/s"
        clients = self.concurrency or profile.concurrency
        return f"closed loop of {clients} clients" if clients else "the measured arrivals, replayed"


@dataclass(frozen=True)
class Prediction:
    latency_s: dict[str, float]  # p50, p95, p99, mean: pooled over the replications
    utilisation: dict[str, float]  # per stage, busy / (replicas x span), mean over the replications
    throughput_per_s: float  # jobs / span, mean over the replications
    max_rate: float  # jobs/s where the bottleneck stage's utilisation reaches 1
    bottleneck: str
    unmeasured: list[str]  # where the prediction goes beyond what the run measured


def _jobs(profile: Profile, load: Load, jobs: int, rng: random.Random) -> tuple[list[float] | None, list[str]]:
    """The simulated jobs' arrival times (None: a closed loop) and classes: the measured run's own, or drawn."""
    if not load.rate and not load.concurrency:
        times = None if profile.concurrency else [at for at, _ in profile.sequence]
        return times, [name for _, name in profile.sequence]
    names, weights = zip(*profile.shares().items(), strict=True)
    drawn = rng.choices(names, weights, k=jobs)
    if load.concurrency:
        return None, drawn
    assert load.rate is not None  # a rate or a concurrency, and not the latter
    return np.cumsum([rng.expovariate(load.rate) for _ in range(jobs)]).tolist(), drawn


def simulate(
    profile: Profile,
    replicas: dict[str, int],
    load: Load = Load(),
    jobs: int | None = None,
    runs: int = 200,
    seed: int = 0,
) -> Prediction:
    """Predict latency, utilisation and throughput at `replicas` (per service) under `load`, from `runs` simulated
    runs of `jobs` jobs each (default, and always when replaying the measured run: as many as it had)."""
    rng = random.Random(seed)
    latencies: list[float] = []
    busy: defaultdict[str, float] = defaultdict(float)
    throughputs: list[float] = []
    for _ in range(runs):
        replication = _Replication(profile, replicas, rng)
        times, names = _jobs(profile, load, jobs or len(profile.sequence), rng)
        if times is None:
            clients = load.concurrency or profile.concurrency
            assert clients  # no arrival times: a closed loop, of the load's clients or the measured run's
            replication.closed(clients, names)
        else:
            replication.open(list(zip(times, names, strict=True)))
        span = replication.run(len(names))
        throughputs.append(len(names) / span)
        latencies += replication.latencies
        for stage, seconds in replication.busy.items():
            busy[stage] += seconds / (replicas[SERVICE_OF[stage]] * span) / runs
    max_rate, bottleneck = profile.max_rate(replicas)
    return Prediction(
        {**{f"p{q}": float(np.percentile(latencies, q)) for q in QUANTILES}, "mean": float(np.mean(latencies))},
        dict(busy),
        float(np.mean(throughputs)),
        max_rate,
        bottleneck,
        profile.unmeasured(replicas),
    )


def by_rate(
    profile: Profile, replicas: dict[str, int], seed: int = 0, fractions=(0.25, 0.5, 0.75, 0.9), runs: int = 50
) -> list[tuple[float, Prediction]]:
    """Predictions under Poisson arrivals at fractions of the largest sustainable rate: where latency turns up."""
    top, _ = profile.max_rate(replicas)
    jobs = max(len(profile.sequence), 100)
    return [(f * top, simulate(profile, replicas, Load(rate=f * top), jobs, runs, seed)) for f in fractions]


def check(prediction: Prediction, folder: Path) -> dict[str, tuple[float, float, float]]:
    """Against a measured run of the predicted configuration: per quantile (measured, predicted, relative error)."""
    measured = summarise(Run.read(folder))["latency_s"]["all"]
    return {
        q: (measured[q], prediction.latency_s[q], prediction.latency_s[q] / measured[q] - 1)
        for q in ("p50", "p95", "p99")
    }


def parse_replicas(text: str, base: dict[str, int]) -> dict[str, int]:
    """ "encoder=1,dit=2,vae=1" over `base` (a service not named keeps its count)."""
    replicas = dict(base)
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, count = item.partition("=")
        if name not in SERVICES or not count.isdigit() or int(count) < 1:
            raise ValueError(
                f"--replicas: {item!r}: expected SERVICE=N with SERVICE one of {', '.join(SERVICES)} and N >= 1"
            )
        replicas[name] = int(count)
    return replicas
