"""The fault walk as a timed benchmark: `h3serve up` on a real machine, N jobs acknowledged, one process SIGKILLed at
its moment; how every acknowledged job ended and how long the stack took to recover.

tests/test_fault_walk.py walks the tiny model on the CPU and holds a job mid-denoise with a test-only hook; this walk
starts a deployment as a user starts it (`h3serve up --config`, its own session) and kills at a moment it watches for.
The deployment is bench.served's (`deployment`: full-size random weights with the --dit / --vae fast paths, or a shipped
profile with --deploy) with the shipped supervision: `[supervisor]` restarts, `[gateway.outage_s]` and the jobs'
attempts as they ship; only `start_timeout_s` is bench.e2e's 900 s (the H200 profiles ship 1200 s).

Victims and their moments:

- `dit-fp8-save`: DiT rank 0 the moment the fp8 store's background save has begun writing, that is once its
  directory aside (`<partition>-fp8-<key>.partial-<pid>`, h3serve/runtime/fp8_store.py) exists in --fp8-cache,
  polled every 50 ms. The cache must start empty, --dit must have fp8, and it needs a GPU (torchao refuses fp8 on a
  CPU; tests/test_fp8_store.py kills a CPU save with that check lifted).
- `dit-compile`: DiT rank 0 at the first job's first `denoising` event while it compiles into an empty
  --compile-cache (no warm-up: the first forward compiled one variant, the next one compiles the other and writes
  it to the cache). Needs --dit with +compile; runs on the CPU too.
- `dit-rank-0`, `encoder`, `gateway`: at the first job's first `denoising` event; `vae`: at its first `decoding`.
- `gateway-x3`: the gateway at that event, then twice more, each as soon as the restarted gateway serves again:
  three kills within a minute.
- `disk-full` (issue 51; needs root): nothing is killed. The gateway's artifacts directory is a small tmpfs mounted
  once the stack serves; at the first job's first `denoising` event a file fills it, for --full-s seconds, then it is
  freed. Its row's "kill to SERVING s" is how long the disk stayed full, "kill to last job s" runs from freeing it.
- `second-up` (issue 51): nothing is killed. At the first job's first `denoising` event a second `h3serve up` starts
  on the same configuration, then one on other ports with the same data_dir; each must be refused (exit 78) naming a
  holder's pid, with no service of its own answering. Its row's "kill to SERVING s" is each one's seconds to its
  refusal; the jobs of the first stack are counted as usual.

The walk then waits for every job to end (--limit-s), printing progress, and prints (with --write also records in
BENCHMARKS.md's "Fault walks" table) the jobs acknowledged, succeeded, failed, lost (the gateway does not know them)
and unfinished, the attempts they used, the seconds from each kill to the victim SERVING again and from the last kill
to the last job's end. After `dit-fp8-save` it waits for the restarted DiT's save and says what the cache holds
(whole partitions, `.partial-` directories left and whose) and whether the restart assigned the weights from the cache
or quantised again (the fp8 store's lines in the DiT's log). Last it stops `up` with SIGTERM, which must exit 0
within its grace. The logs stay in --out (default: a new directory under var/).

    # one H200, issue 29's "a kill during the fp8 save": 0 acknowledged jobs failed or lost
    python -m bench.fault_walk --victim dit-fp8-save --jobs 5 --size 480x832x124 --steps 4 \\
        --fp8-cache var/fp8-walk --dit native+compile+dynamic+fp8 --vae native+tiles=28 --out var/walk-fp8 --write
    python -m bench.fault_walk --quick --victim gateway --jobs 2          # tiny preset on the CPU: the harness
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import grpc

from bench.common import Size, device_label, leaves_gpu_empty, software
from bench.deployment import profile_deployment
from bench.dit_step import parse_variant
from bench.results import WALK_COUNTS, Record, add_output_arguments, command_line, update_results
from bench.served import (
    PROMPT,
    SEED,
    add_deployment_arguments,
    cache_state,
    deployment,
    dit_info,
    placement,
    print_logs,
    services_text,
    wait_for_fp8_save,
)
from h3serve.client import GatewayClient, describe_event
from h3serve.common import forkserver, processes
from h3serve.common.config import load_deploy
from h3serve.common.server import is_serving
from h3serve.runtime import fp8_store
from h3serve.v1 import common_pb2, gateway_pb2

FP8_SAVE = "dit-fp8-save"
COMPILING = "dit-compile"
SAVING = "saving"  # the moment of FP8_SAVE: the fp8 save's directory aside exists
PARTIAL = ".partial-"  # fp8_store's directory aside: `<partition>-fp8-<key>.partial-<writer pid>`


@dataclass(frozen=True)
class Victim:
    service: str  # whose SERVING says the victim is back; "dit" means its rank 0
    moment: str  # the first job's event kind to kill at, or SAVING
    kills: int = 1


VICTIMS = {
    FP8_SAVE: Victim("dit", SAVING),
    COMPILING: Victim("dit", "denoising"),
    "dit-rank-0": Victim("dit", "denoising"),
    "vae": Victim("vae", "decoding"),
    "encoder": Victim("encoder", "denoising"),
    "gateway": Victim("gateway", "denoising"),
    "gateway-x3": Victim("gateway", "denoising", kills=3),
}
TERMINAL = (gateway_pb2.JOB_STATE_SUCCEEDED, gateway_pb2.JOB_STATE_FAILED, gateway_pb2.JOB_STATE_CANCELLED)
QUICK = dict(size="32x64x124", dtype="float32", model_dir="")  # the tiny preset
QUICK_STEPS = 2  # 1 DiT forward a job, unless --steps says otherwise
POLL_S = 0.1  # kill to SERVING is measured to this
SAVE_POLL_S = 0.05  # the kill lands within this of the fp8 save's start
JOBS_POLL_S = 1.0
PROGRESS_S = 5.0
RESUME_S = 1.0  # gateway-x3: a restarted gateway has put its jobs back in the stage queues when it dies again
STOP_MARGIN_S = 15.0  # past [supervisor] stop_grace_s: the fork server's stop, then `up`'s own exit
STARTED_MARGIN_S = 60.0  # past start_timeout_s, up's own limit for a start: the fork server and the gateway


@dataclass(frozen=True)
class Kill:
    pid: int
    at: float  # unix seconds
    back_s: float | None  # to the victim SERVING again (None: not within --limit-s)
    pid_after: int | None  # the victim's process once back


@dataclass(frozen=True)
class SaveAtKill:
    """The fp8 save the kill interrupted, as it was the moment before: its directory aside and the files in it."""

    directory: Path
    files: int


def writer(partial: Path) -> int:
    """The pid of the process that writes (or wrote) a save's directory aside."""
    return int(partial.name.rpartition(PARTIAL)[2])


@dataclass(frozen=True)
class Fp8Aftermath:
    """--fp8-cache once the restarted DiT's own save has ended, and how that DiT got its weights."""

    killed: SaveAtKill
    whole: list[str]  # saved partitions
    partials: list[str]  # directories aside left, each with whose save it was
    restart: list[str]  # the fp8 store's log lines since the kill

    def verdict(self) -> str:
        lines = " ".join(self.restart)
        if "fp8 weights assigned from" in lines:
            return "the restart assigned the weights from the cache"
        if "quantising" in lines:
            saved = "fp8 weights saved to" in lines
            return "the restart quantised again" + (" and saved them whole" if saved else ", saved nothing")
        return "the DiT's log says nothing of a restart's fp8 weights"

    def describe(self) -> str:
        return (
            f"killed while {self.killed.directory.name} held {self.killed.files} file(s); after: "
            f"{len(self.whole)} whole ({', '.join(self.whole) or 'none'}), "
            f"{'; '.join(self.partials) or f'no {PARTIAL} left'}; {self.verdict()}"
        )


@dataclass(frozen=True)
class Walk:
    victim: str
    jobs: dict[str, int]  # WALK_COUNTS
    kills: list[Kill]
    last_job_s: float | None  # from the last kill to the last job's end
    errors: list[str]  # why the jobs that failed did
    fp8: Fp8Aftermath | None = None
    up_exit: int | None = None  # after SIGTERM; None: not within its grace (it was then killed)


class Stack:
    """`h3serve up --config CONFIG` as from a terminal: its own session, and without a fork server of the caller's (it
    starts its own, so every process it starts descends from it), the logs under `work`."""

    def __init__(self, config_path: Path, work: Path) -> None:
        self.config, self.config_path = load_deploy(config_path), config_path
        self.log_dir, self.output = work / "logs", work / "up.out"
        environment = {key: value for key, value in os.environ.items() if key != forkserver.ENV}
        command = [sys.executable, "-m", "h3serve.cli", "up", "--config", str(config_path)]
        with open(self.output, "wb") as out:
            self.process = subprocess.Popen(
                [*command, "--log-dir", str(self.log_dir)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=environment,
            )

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:  # a walk that failed: nothing it started may outlive it
            self.stop()

    def address(self, service: str) -> str:
        gateway = self.config.gateway
        return f"{gateway.host}:{gateway.port}" if service == "gateway" else self.config.service(service).address

    def check(self) -> None:
        """Raise once `up` has ended by itself (a refusal, a restart budget spent): nothing will come back."""
        code = self.process.poll()
        if code is not None:
            tail = self.output.read_text(errors="replace").splitlines()[-20:]
            raise RuntimeError(f"h3serve up exited with code {code}:\n" + "\n".join(tail))

    def serving(self, service: str) -> bool:
        self.check()
        return is_serving(self.address(service))

    def wait_serving(self) -> None:
        limit_s = self.config.supervisor.start_timeout_s + STARTED_MARGIN_S
        services = ("encoder", "dit", "vae", "gateway")
        started = time.monotonic()
        if not until(lambda: all(map(self.serving, services)), limit_s, "every service SERVING", poll_s=0.5):
            raise RuntimeError(f"not every service SERVING within {limit_s:.0f} s")
        print(f"every service SERVING {time.monotonic() - started:.1f} s after `h3serve up`", flush=True)

    def pid(self, service: str) -> int | None:
        """The process a kill of `service` ends: DiT rank 0 as the DiT's Info lists it, else the service's process,
        found by its command line (`h3serve serve NAME`, also for a fork of the fork server); None while it has
        none."""
        if service == "dit":
            try:
                return next((rank.pid for rank in dit_info(self.config).ranks if rank.rank == 0), None)
            except grpc.RpcError:  # restarting
                return None
        return processes.service_pid(self.process.pid, service)

    def dit_log(self) -> Path:
        return self.log_dir / "dit.log"

    def stop(self) -> int | None:
        """SIGTERM, as a Ctrl-C: `up` stops every service within [supervisor] stop_grace_s. Its exit code; None when
        it had not exited by then (it is then killed)."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(self.config.supervisor.stop_grace_s + STOP_MARGIN_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)  # its services follow: their parent-death signal
            self.process.wait()
            return None


def until(
    condition: Callable, limit_s: float, waiting_for: str, report: Callable[[], str] | None = None, poll_s=POLL_S
):
    """`condition()`'s first truthy value, asked every `poll_s`, saying every PROGRESS_S what it waits for (and
    `report()`); None when `limit_s` passes first."""
    started = printed = time.monotonic()
    while not (value := condition()):
        now = time.monotonic()
        if now - started >= limit_s:
            return None
        if now - printed >= PROGRESS_S:
            said = f": {report()}" if report else ""
            print(f"  {now - started:5.0f} s waiting for {waiting_for}{said}", flush=True)
            printed = now
        time.sleep(poll_s)
    return value


def job_request(args, number: int) -> gateway_pb2.GenerateRequest:
    """bench.e2e's prompt at --size and --steps, a seed of its own per job."""
    size = Size.parse(args.size)
    params = common_pb2.GenerationParams(num_inference_steps=args.steps, seed=SEED + number)
    return gateway_pb2.GenerateRequest(
        prompt=PROMPT, height=size.height, width=size.width, num_frames=size.frames, params=params
    )


def poll_jobs(client: GatewayClient, job_ids: list[str]) -> dict[str, gateway_pb2.Job | None] | None:
    """Each job as the gateway has it now (None: it does not know the job, lost); None while it does not answer."""
    found: dict[str, gateway_pb2.Job | None] = {}
    for job_id in job_ids:
        try:
            found[job_id] = client.stub.GetJob(gateway_pb2.GetJobRequest(job_id=job_id), timeout=5)
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.NOT_FOUND:
                return None
            found[job_id] = None
    return found


def state_name(job: gateway_pb2.Job | None) -> str:
    return "lost" if job is None else gateway_pb2.JobState.Name(job.state).removeprefix("JOB_STATE_").lower()


def progress(stack: Stack, client: GatewayClient, job_ids: list[str], service: str) -> str:
    """Which jobs are where, and whether the victim's service serves."""
    polled = poll_jobs(client, job_ids)
    jobs = "the gateway does not answer" if polled is None else dict(Counter(map(state_name, polled.values())))
    return f"jobs {jobs}; {service} {'SERVING' if stack.serving(service) else 'not serving'}"


def wait_for_event(client: GatewayClient, job_id: str, kind: str) -> None:
    """Until the job's first event of `kind`, returned the moment it comes, so that the kill lands right after it."""
    for event in client.events(job_id):
        if event.WhichOneof("kind") == kind:
            return
        last = event
    raise RuntimeError(f"job {job_id} ended ({describe_event(last)}) before any {kind} event: no moment to kill at")


def wait_for_save(cache: Path, limit_s: float) -> SaveAtKill:
    """The fp8 save's directory aside once it exists, and the files in it then; refused when the save has already
    ended: only a DiT whose weights stay on the GPU, unsharded, saves in the background while it serves (with FSDP or
    group offload it saves before it turns SERVING)."""

    def saving() -> Path | None:
        partials = sorted(cache.glob(f"*{PARTIAL}*"))
        if not partials and whole(cache):
            raise SystemExit(
                f"bench.fault_walk: the fp8 save into {cache} had ended ({', '.join(whole(cache))}) by the time the "
                "jobs were acknowledged: no save left to kill (FSDP and group offload save before the DiT serves)"
            )
        return partials[0] if partials else None

    partial = until(saving, limit_s, f"the fp8 save to begin in {cache}", poll_s=SAVE_POLL_S)
    if partial is None:
        raise RuntimeError(f"no fp8 save began in {cache} within {limit_s:.0f} s")
    return SaveAtKill(partial, len(list(partial.iterdir())))


def whole(cache: Path) -> list[str]:
    """The partitions saved whole in the fp8 cache."""
    return sorted(p.name for p in cache.iterdir() if PARTIAL not in p.name) if cache.is_dir() else []


def kill(stack: Stack, service: str, limit_s: float, report: Callable[[], str]) -> Kill:
    """SIGKILL the victim; once it is dead (its port closed), the seconds until its service serves again."""
    pid = stack.pid(service)
    victim = processes.Proc.of(pid) if pid else None
    if pid is None or victim is None:
        raise RuntimeError(f"no {service} process to kill")
    at, started = time.time(), time.monotonic()
    os.kill(pid, signal.SIGKILL)
    print(f"SIGKILLed {service} pid {pid}", flush=True)
    until(lambda: not victim.alive(), limit_s, f"pid {pid} to die")
    back = until(lambda: stack.serving(service), limit_s, f"{service} SERVING again", report)
    back_s = time.monotonic() - started if back else None
    pid_after = stack.pid(service) if back else None
    print(f"{service} SERVING again after {back_s:.1f} s, pid {pid_after}" if back else f"{service} not back")
    return Kill(pid, at, back_s, pid_after)


def fp8_aftermath(stack: Stack, cache: Path, killed: SaveAtKill, log_from: int) -> Fp8Aftermath:
    """The cache once no save is in flight (the restarted DiT's own, which a stop would cut), and what the fp8 store
    logged since the kill (`log_from`: the DiT log's size then)."""
    wait_for_fp8_save(str(cache))
    running, partials = fp8_store.saves_in_flight(cache), []
    for partial in sorted(cache.glob(f"*{PARTIAL}*")):
        whose = "the killed rank 0's" if writer(partial) == writer(killed.directory) else f"pid {writer(partial)}'s"
        partials.append(f"{partial.name} ({whose}, {'still writing' if partial in running else 'its writer dead'})")
    with open(stack.dit_log(), "rb") as log:
        log.seek(log_from)
        lines = log.read().decode(errors="replace").splitlines()
    restart = [line.partition("h3serve.fp8_store: ")[2] for line in lines if "h3serve.fp8_store: " in line]
    return Fp8Aftermath(killed, whole(cache), partials, restart)


def walk(stack: Stack, args, victim: Victim) -> Walk:
    """Submit, kill at the moment, follow every job to its end."""
    with GatewayClient(stack.address("gateway")) as client:
        job_ids = [client.submit(job_request(args, number)).job_id for number in range(args.jobs)]
        print(f"{len(job_ids)} jobs acknowledged: {', '.join(job_ids)}", flush=True)

        def report() -> str:
            return progress(stack, client, job_ids, victim.service)

        save, log_from, kills = None, 0, []
        if victim.moment == SAVING:
            save, log_from = wait_for_save(Path(args.fp8_cache), args.limit_s), stack.dit_log().stat().st_size
        else:
            print(f"waiting for job {job_ids[0]}'s first {victim.moment} event", flush=True)
            wait_for_event(client, job_ids[0], victim.moment)
        for number in range(victim.kills):
            if number:
                time.sleep(RESUME_S)
            kills.append(kill(stack, victim.service, args.limit_s, report))
        latest = follow(client, job_ids, args.limit_s, report)
    fp8 = fp8_aftermath(stack, Path(args.fp8_cache), save, log_from) if save else None
    return outcome(args.victim, job_ids, latest, kills, fp8)


def follow(
    client: GatewayClient, job_ids: list[str], limit_s: float, report: Callable[[], str]
) -> dict[str, gateway_pb2.Job | None]:
    """Each job as the gateway last told it, once every one has ended or is lost, or `limit_s` has passed."""
    latest: dict[str, gateway_pb2.Job | None] = {}

    def ended() -> bool:
        latest.update(poll_jobs(client, job_ids) or {})
        return len(latest) == len(job_ids) and all(job is None or job.state in TERMINAL for job in latest.values())

    until(ended, limit_s, "every job to end", report, poll_s=JOBS_POLL_S)
    return latest


def outcome(victim: str, job_ids: list[str], latest: dict[str, gateway_pb2.Job | None], kills: list[Kill], fp8) -> Walk:
    """The jobs counted by how they ended (cancelled counts as failed: nothing here cancels); a job not seen ended is
    unfinished."""
    lost = [job_id for job_id, job in latest.items() if job is None]
    ended = [job for job in latest.values() if job is not None and job.state in TERMINAL]
    failed = [job for job in ended if job.state != gateway_pb2.JOB_STATE_SUCCEEDED]
    counts = {
        "acknowledged": len(job_ids),
        "succeeded": len(ended) - len(failed),
        "failed": len(failed),
        "lost": len(lost),
        "unfinished": len(job_ids) - len(ended) - len(lost),
        "attempts": sum(job.attempts for job in latest.values() if job is not None),
    }
    last_job_s = max(job.updated for job in ended) - kills[-1].at if ended else None
    errors = [f"{job.job_id}: {job.error.message or state_name(job)}" for job in failed]
    return Walk(victim, {key: counts[key] for key in WALK_COUNTS}, kills, last_job_s, errors, fp8)


def run(args, device: str, work: Path) -> Walk:
    """The stack up from bench.e2e's deployment, the walk, the stop."""
    settings = argparse.Namespace(**vars(args), sizes=args.size, warm_start=False, adapter_file="")  # no warm-up
    try:
        config_path = deployment(settings, device, work)
    except ValueError as exc:
        raise SystemExit(f"bench.fault_walk: {exc}") from exc
    with leaves_gpu_empty(), Stack(config_path, work) as stack:
        try:
            stack.wait_serving()
            walker = WITHOUT_KILLS.get(args.victim)
            result = walker(stack, args, work) if walker else walk(stack, args, VICTIMS[args.victim])
        except BaseException:
            print_logs(stack.log_dir)
            raise
        return replace(result, up_exit=stack.stop())


def refusal(args, device: str) -> str:
    """Why the walk cannot run as asked ("" when it can), said before anything starts."""
    out = Path(args.out)
    if out.is_dir() and any(out.iterdir()):
        return f"--out {out} holds an earlier run (a gateway's jobs, logs): give a new or empty directory"
    if args.victim == COMPILING:
        return compiling_refusal(args)
    if args.victim != FP8_SAVE:
        return ""
    if device == "cpu":
        return f"--victim {FP8_SAVE} needs a GPU: torchao refuses fp8 on a CPU, so the DiT saves no fp8 weights there"
    if not args.deploy and not parse_variant(args.dit).fp8:
        return f"--victim {FP8_SAVE} kills the DiT while it saves its fp8 weights: --dit {args.dit} has no +fp8"
    cache = Path(args.fp8_cache) if args.fp8_cache else None
    if cache is None:
        return f"--victim {FP8_SAVE} needs --fp8-cache DIR, an empty directory the DiT's first start saves into"
    if cache.is_dir() and any(cache.iterdir()):
        held = ", ".join(sorted(p.name for p in cache.iterdir()))
        return f"--fp8-cache {cache} is not empty ({held}): a start would assign those weights and save nothing"
    return ""


# The walks without a kill (issue 51): the disk filling under running jobs, and a second `up` beside the first.

DISK_MIB = 64  # the artifacts' tmpfs of the disk-full walk: filled whole, its size does not matter
REFUSED_WITHIN_S = 2.0  # a second `up` is refused within this (issue 51)


def disk_full_walk(stack: Stack, args, work: Path) -> Walk:
    """Jobs in flight while the artifacts' disk is full for --full-s seconds, then freed: how every job ended."""
    artifacts = Path(stack.config.gateway.data_dir) / "artifacts"
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_MIB}m", "tmpfs", str(artifacts)], check=True)
    try:
        with GatewayClient(stack.address("gateway")) as client:
            job_ids = [client.submit(job_request(args, number)).job_id for number in range(args.jobs)]
            print(f"{len(job_ids)} jobs acknowledged: {', '.join(job_ids)}", flush=True)
            wait_for_event(client, job_ids[0], "denoising")
            filler, filled = fill(artifacts), time.time()
            print(f"{artifacts} full; freeing it in {args.full_s:g} s", flush=True)
            time.sleep(args.full_s)
            filler.unlink()
            freed = time.time()
            latest = follow(client, job_ids, args.limit_s, lambda: progress(stack, client, job_ids, "gateway"))
    finally:
        stack.stop()  # before the unmount: the gateway writes there
        subprocess.run(["umount", str(artifacts)], check=False)
    return outcome(args.victim, job_ids, latest, [Kill(0, freed, freed - filled, None)], None)


def fill(directory: Path) -> Path:
    """A file that takes every free byte of `directory`'s file system."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as file:
        try:
            while True:
                file.write(bytes(1 << 20))
        except OSError:
            pass
    return filler


def second_up_walk(stack: Stack, args, work: Path) -> Walk:
    """While the first stack's jobs run, a second `up` on the same configuration, then one on other ports with the
    same data_dir: each refused (exit 78) within REFUSED_WITHIN_S, naming a holder's pid, none of its services
    answering; then every job of the first followed to its end."""
    same = Path(stack.config_path)
    other = profile_deployment(same, {}, work / "second-up-other-ports.toml")  # fresh ports, the same data_dir
    with GatewayClient(stack.address("gateway")) as client:
        job_ids = [client.submit(job_request(args, number)).job_id for number in range(args.jobs)]
        print(f"{len(job_ids)} jobs acknowledged: {', '.join(job_ids)}", flush=True)
        wait_for_event(client, job_ids[0], "denoising")
        began = time.time()
        attempts, errors = [second_up(config, work) for config in (same, other)], []
        for config, (seconds, problem) in zip((same, other), attempts, strict=True):
            print(f"second `h3serve up --config {config}`: {problem or 'refused'} in {seconds:.2f} s", flush=True)
            errors += [f"second up on {config.name}: {problem}"] if problem else []
        latest = follow(client, job_ids, args.limit_s, lambda: progress(stack, client, job_ids, "gateway"))
    walked = outcome(args.victim, job_ids, latest, [Kill(0, began, s, None) for s, _ in attempts], None)
    return replace(walked, errors=walked.errors + errors)


def second_up(config: Path, work: Path) -> tuple[float, str]:
    """Seconds to the second `up`'s exit, and what was wrong with it ("" when it was refused as promised)."""
    logs = work / f"second-up-{config.stem}"
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "h3serve.cli", "up", "--config", str(config), "--log-dir", str(logs)],
        capture_output=True,
        text=True,
        timeout=STARTED_MARGIN_S,
    )
    seconds = time.monotonic() - started
    refusal = next((line for line in done.stderr.splitlines() if line.startswith("refused: ")), "")
    problems = [
        f"exit {done.returncode}, not {processes.EXIT_REFUSED}" if done.returncode != processes.EXIT_REFUSED else "",
        "" if " in use by pid " in refusal else f"no holder's pid named: {refusal or done.stderr[-300:]}",
        f"took {seconds:.1f} s, over {REFUSED_WITHIN_S:g} s" if seconds > REFUSED_WITHIN_S else "",
        "its services started (logs written)" if logs.exists() else "",
    ]
    return seconds, "; ".join(problem for problem in problems if problem)


WITHOUT_KILLS: dict[str, Callable[[Stack, argparse.Namespace, Path], Walk]] = {
    "disk-full": disk_full_walk,
    "second-up": second_up_walk,
}


def compiling_refusal(args) -> str:
    if args.deploy or not parse_variant(args.dit).compile:
        return f"--victim {COMPILING} kills the DiT while it compiles: give --dit with +compile (and no --deploy)"
    cache = Path(args.compile_cache) if args.compile_cache else None
    if cache is None or (cache.is_dir() and any(cache.iterdir())):
        return f"--victim {COMPILING} needs --compile-cache DIR, an empty directory the DiT compiles into"
    return ""


def print_walk(walk: Walk, args, device: str) -> None:
    counts = " | ".join(str(walk.jobs[key]) for key in WALK_COUNTS)
    back = ", ".join("not back" if k.back_s is None else f"{k.back_s:.1f}" for k in walk.kills)
    last = "-" if walk.last_job_s is None else f"{walk.last_job_s:.1f}"
    print(f"\n| victim | {' | '.join(WALK_COUNTS)} | kill to SERVING s | kill to last job s |")
    print("|---" * (len(WALK_COUNTS) + 3) + "|")
    print(f"| {walk.victim} | {counts} | {back} | {last} |")
    for k in (k for k in walk.kills if k.pid):  # the walks without kills (WITHOUT_KILLS) have none to tell
        print(f"killed pid {k.pid} at {datetime.datetime.fromtimestamp(k.at):%H:%M:%S.%f}; after it: pid {k.pid_after}")
    if len(walk.kills) > 1 and walk.kills[0].pid:
        print(f"{len(walk.kills)} kills within {walk.kills[-1].at - walk.kills[0].at:.1f} s")
    for error in walk.errors:
        print(f"failed: {error}")
    if walk.fp8:
        print(f"fp8 cache {args.fp8_cache}: {walk.fp8.describe()}")
        print("\n".join(f"  DiT log since the kill: {line}" for line in walk.fp8.restart))
    place = placement(args, device)
    jobs = f"{args.jobs} jobs of {args.size}, {args.steps} steps"
    print(f"deployment: {services_text(args, place)}{args.cache_state}; {jobs}")
    print(f"command: {args.command}")
    print(f"machine: {device_label(device, place.gpus)}, {software()}, {datetime.date.today().isoformat()}")
    print(f"h3serve up after SIGTERM: {'exit code ' + str(walk.up_exit) if walk.up_exit is not None else 'killed'}")
    print(f"logs: {args.out}/logs (h3serve up's own output: {args.out}/up.out)")


def record(walk: Walk, args, device: str) -> Record:
    place = placement(args, device)
    return Record(
        name=f"fault_walk_{walk.victim}_{args.size}_{args.steps}steps",
        device=device_label(device, place.gpus),
        world_size=place.world_size,
        dtype=args.dtype,
        seconds=walk.last_job_s or 0.0,
        baseline_seconds=0.0,
        ratio=0.0,
        peak_gib=0.0,
        command=args.command,
        date=datetime.date.today().isoformat(),
        variant=services_text(args, place) + args.cache_state,
        baseline="",
        software=software(),
        jobs=walk.jobs,
        back_seconds=[k.back_s for k in walk.kills],
        fp8_cache_after=walk.fp8.describe() if walk.fp8 else None,
    )


def main(argv: list[str] | None = None) -> Walk:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny preset on CPU: a smoke test of the harness")
    p.add_argument("--victim", required=True, choices=[*VICTIMS, *WITHOUT_KILLS])
    p.add_argument("--full-s", type=float, default=20.0, help="disk-full: how long the artifacts' disk stays full")
    p.add_argument("--jobs", type=int, default=5, help="jobs acknowledged before the kill")
    p.add_argument("--size", default="480x832x124", help="each job's HxWxFRAMES")
    p.add_argument("--steps", type=int, help="num_inference_steps of each job (default 4; --quick: 2)")
    p.add_argument("--limit-s", type=float, default=900.0, help="how long the victim and the jobs may take")
    p.add_argument("--out", help="the deployment, its logs and the gateway's data (default: a new var/ directory)")
    add_deployment_arguments(p)
    add_output_arguments(p)
    args = p.parse_args(argv)
    args.command = command_line("bench.fault_walk", argv)
    if args.quick:
        vars(args).update(QUICK)
    args.steps = args.steps or (QUICK_STEPS if args.quick else 4)
    args.out = args.out or f"var/fault-walk-{args.victim}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    device = "cpu" if args.quick else "cuda"
    if reason := refusal(args, device):
        raise SystemExit(f"bench.fault_walk: {reason}")
    args.cache_state = cache_state(args)
    work = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    result = run(args, device, work)
    print_walk(result, args, device)
    if args.write:
        update_results([record(result, args, device)], args.results, args.markdown)
    return result


if __name__ == "__main__":
    main()
