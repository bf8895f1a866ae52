"""The fault walk as a timed benchmark: `h3serve up` on a real machine, N jobs acknowledged, one process SIGKILLed at
its moment; how every acknowledged job ended and how long the stack took to recover.

tests/test_fault_walk.py walks the tiny model on the CPU and holds a job mid-denoise with a test-only hook; this walk
starts a deployment as a user starts it (`h3serve up --config`, its own session) and kills at a moment it watches for.
This module is the runner (victims, kills, the row); the stack it starts is bench/walk_stack.py, the jobs it
follows bench/walk_jobs.py, the fp8 save's moment bench/walk_fp8.py, the walks that kill nothing
bench/walks_without_kills.py.
The deployment is bench.served's (`deployment`: full-size random weights with the --dit / --vae fast paths, or a shipped
profile with --deploy) with the shipped supervision: `[supervisor]` restarts, `[gateway.outage_s]` and the jobs'
attempts as they ship; only `start_timeout_s` is bench.e2e's 900 s (the H200 profiles ship 1200 s).

Victims and their moments:

- `dit-fp8-save`: DiT rank 0 the moment the fp8 store's background save has begun writing, that is once its
  directory aside (`<partition>-fp8-<key>.partial-<pid>`, h3serve/runtime/quantised_store.py) exists in --fp8-cache,
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
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from bench.common import device_label, leaves_gpu_empty, software
from bench.dit_step import parse_variant
from bench.results import WALK_COUNTS, Record, add_output_arguments, command_line, update_results
from bench.served import (
    add_deployment_arguments,
    cache_state,
    deployment,
    placement,
    print_logs,
    services_text,
)
from bench.walk_fp8 import SAVING, fp8_aftermath, wait_for_save
from bench.walk_jobs import Kill, Walk, follow, job_request, outcome, progress, wait_for_event
from bench.walk_stack import Stack, until
from bench.walks_without_kills import WITHOUT_KILLS
from h3serve.client import GatewayClient
from h3serve.common import processes

FP8_SAVE = "dit-fp8-save"
COMPILING = "dit-compile"


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
QUICK = dict(size="32x64x124", dtype="float32", model_dir="")  # the tiny preset
QUICK_STEPS = 2  # 1 DiT forward a job, unless --steps says otherwise
RESUME_S = 1.0  # gateway-x3: a restarted gateway has put its jobs back in the stage queues when it dies again


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
