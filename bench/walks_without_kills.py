"""The fault walks that kill nothing (issue 51): the artifacts' disk filling under running jobs (`disk-full`, needs
root), and a second `h3serve up` beside the first (`second-up`), each refused naming a holder."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from bench.deployment import profile_deployment
from bench.walk_jobs import Kill, Walk, follow, job_request, outcome, progress, wait_for_event
from bench.walk_stack import STARTED_MARGIN_S, Stack
from h3serve.client import GatewayClient
from h3serve.common import processes

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
