"""Soak: C clients generating back to back for M minutes through the whole stack, tiny model on CPU.

Starts encoder, DiT, VAE and gateway with the demo deployment's settings and otherwise the shipped defaults
(retention included: bench/deployment.py), then C threads each submit a t2va job (a new prompt and seed
every time, so each pays its encode), wait for its end and submit the next. Every --sample-s it samples the
resident memory of each service's process tree and the size of the gateway's data directory. Prints the
samples and a summary: jobs done and failed, latency p50/p95 of the first and the last quarter, memory and
disk growth per job. --write adds a row (seconds: p50 of the last quarter; baseline: p50 of the first, so
the ratio shows drift) to bench/results.json and BENCHMARKS.md.

    python -m bench.soak [--minutes 20] [--clients 4] [--height 64 --width 128 --steps 8] [--write]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench.deployment import add_request_arguments, cpu_record, tiny_deployment
from bench.results import add_output_arguments, update_results
from h3serve.cli.launcher import ServiceGroup
from h3serve.client import GatewayClient
from h3serve.common.config import load_deploy
from h3serve.common.processes import descendants
from h3serve.v1 import common_pb2, gateway_pb2


@dataclass(frozen=True)
class Finished:
    at_s: float  # since the soak started
    seconds: float  # submit to terminal event
    done: bool


@dataclass(frozen=True)
class Sample:
    at_s: float
    jobs: int
    rss_mib: dict[str, float]  # per service, its whole process tree
    data_mib: float


def rss_mib(pid: int) -> float:
    """Resident memory of a process and its descendants (a process gone meanwhile counts 0)."""
    total_kib = 0
    for each in (pid, *descendants(pid)):
        try:
            with open(f"/proc/{each}/status") as status:
                total_kib += next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total_kib / 1024


def tree_mib(root: Path) -> float:
    return sum(path.stat().st_size for path in root.rglob("*") if path.is_file()) / 2**20


def sample(group: ServiceGroup, root: Path, started: float, finished: list[Finished]) -> Sample:
    taken = Sample(
        time.monotonic() - started,
        len(finished),
        {r.name: rss_mib(r.process.pid) for r in group.running},
        tree_mib(root / "gateway"),
    )
    print(
        f"{taken.at_s:7.0f} s  {taken.jobs:6d} jobs  RSS "
        + "  ".join(f"{name} {mib:.0f}" for name, mib in taken.rss_mib.items())
        + f" MiB  data {taken.data_mib:.1f} MiB",
        flush=True,
    )
    return taken


def client_loop(address: str, args, number: int, started: float, deadline: float, out: list[Finished]) -> None:
    client = GatewayClient(address)
    try:
        for job in range(1 << 30):
            if time.monotonic() >= deadline:
                return
            params = common_pb2.GenerationParams(num_inference_steps=args.steps, seed=job)
            request = gateway_pb2.GenerateRequest(
                prompt=f"soak client {number} job {job}", height=args.height, width=args.width, params=params
            )
            submitted = time.monotonic()
            final = client.generate(request)
            now = time.monotonic()
            out.append(Finished(now - started, now - submitted, final.HasField("done")))
    finally:
        client.close()


def soak(args) -> tuple[list[Finished], list[Sample]]:
    finished: list[Finished] = []
    samples: list[Sample] = []
    with tempfile.TemporaryDirectory(prefix="h3serve-soak-") as tmp:
        root = Path(tmp)
        config = tiny_deployment(root)
        deploy = load_deploy(config)
        with ServiceGroup(deploy, str(config), log_dir=str(root)) as group:
            started = time.monotonic()
            deadline = started + args.minutes * 60
            address = f"127.0.0.1:{deploy.gateway.port}"
            clients = [
                threading.Thread(target=client_loop, args=(address, args, n, started, deadline, finished))
                for n in range(args.clients)
            ]
            for thread in clients:
                thread.start()
            while (left := deadline - time.monotonic()) > 0:
                samples.append(sample(group, root, started, finished))
                time.sleep(min(args.sample_s, left))
            for thread in clients:  # each finishes the job it is in
                thread.join()
            samples.append(sample(group, root, started, finished))
    return finished, samples


def quarter_p(finished: list[Finished], last: bool, q: float) -> float:
    span = max(f.at_s for f in finished)
    part = [f.seconds for f in finished if (f.at_s >= 0.75 * span if last else f.at_s <= 0.25 * span)]
    return statistics.quantiles(part, n=100)[int(q * 100) - 1] if len(part) > 1 else part[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--clients", type=int, default=4)
    add_request_arguments(parser, steps=8)
    parser.add_argument("--sample-s", type=float, default=60.0, help="seconds between memory and disk samples")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    finished, samples = soak(args)
    first, last = samples[1] if len(samples) > 1 else samples[0], samples[-1]  # after the first jobs warmed up
    jobs = max(1, last.jobs - first.jobs)
    early, late = quarter_p(finished, False, 0.5), quarter_p(finished, True, 0.5)
    print(
        f"\n{len(finished)} jobs in {args.minutes:g} min, {args.clients} clients, {args.height}x{args.width}, "
        f"{args.steps} steps: {sum(f.done for f in finished)} done, {sum(not f.done for f in finished)} not\n"
        f"| quarter | p50 s | p95 s |\n|---|---|---|\n"
        f"| first | {early:.2f} | {quarter_p(finished, False, 0.95):.2f} |\n"
        f"| last | {late:.2f} | {quarter_p(finished, True, 0.95):.2f} |\n"
        f"RSS growth from {first.at_s:.0f} s to {last.at_s:.0f} s ({jobs} jobs): "
        + ", ".join(f"{name} {last.rss_mib[name] - first.rss_mib[name]:+.1f} MiB" for name in last.rss_mib)
        + f"; data directory {1024 * (last.data_mib - first.data_mib) / jobs:+.1f} KiB per job"
    )
    if args.write:
        record = cpu_record(
            "bench.soak",
            argv,
            name=f"soak_{args.minutes:g}min_{args.clients}clients_{args.height}x{args.width}x{args.steps}steps",
            seconds=late,
            baseline_seconds=early,
            ratio=early / late,
            peak_gib=max(sum(s.rss_mib.values()) for s in samples) / 1024,
            variant="p50 latency, last quarter",
            baseline="p50 latency, first quarter (drift)",
        )
        update_results([record], args.results, args.markdown)


if __name__ == "__main__":
    main()
