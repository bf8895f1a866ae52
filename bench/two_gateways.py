"""Several gateways on one PostgreSQL job store, under load: every job committed exactly once, and what the store
costs against SQLite.

Starts PostgreSQL (the OS packages, as the tests do: bench/job_stores.py) and the tiny model's encoder, DiT and VAE on
CPU (bench/deployment.py), then three runs of the same tiny jobs from `--clients` client threads, each job submitted
and followed to its end (submit-to-finish), its client's gateway by turns:

1. two gateways on one PostgreSQL database (the load run): counted from the store afterwards, per job: lost (never
   SUCCEEDED) and double commits (events not 1..N, not exactly one terminal event, or not exactly one artifact);
2. one gateway on PostgreSQL; 3. one gateway on SQLite (the default store): their submit-to-finish throughput.

A lost job or a double commit fails the bench. --write adds two rows to bench/results.json and BENCHMARKS.md: the
two gateways against one (both PostgreSQL), and one gateway on PostgreSQL against SQLite.

    python -m bench.two_gateways [--jobs 200 --clients 16 --steps 2 --height 32 --width 64] [--write]
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import tempfile
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from bench.deployment import MODEL_SERVICES, cpu_record, tiny_deployment
from bench.job_stores import Backend, start_postgres
from bench.results import add_output_arguments, update_results
from h3serve.cli.launcher import ServiceGroup, is_answering
from h3serve.client import GatewayClient
from h3serve.client.events import is_terminal
from h3serve.common.config import load_deploy
from h3serve.common.deploy_toml import dumps
from h3serve.common.free_ports import free_port
from h3serve.v1 import common_pb2, gateway_pb2

S = gateway_pb2


@dataclass(frozen=True)
class LoadCounts:
    submitted: int
    succeeded: int
    lost: int  # submitted, never SUCCEEDED (or not in the store at all)
    double_commits: int  # events not 1..N, other than one terminal event, or other than one artifact


def _request(tag: str, index: int, steps: int, height: int, width: int) -> gateway_pb2.GenerateRequest:
    return S.GenerateRequest(
        prompt=f"two gateways {tag} {index}",
        height=height,
        width=width,
        params=common_pb2.GenerationParams(num_inference_steps=steps, seed=index),
        request_id=f"{tag}-{index}",
    )


def _submit_and_follow(address: str, request: gateway_pb2.GenerateRequest) -> str:
    """The job's id once its terminal event has come (through reconnections, if its stream breaks)."""
    with GatewayClient(address) as client:
        job = client.submit(request)
        for _ in client.events(job.job_id):
            pass
    return job.job_id


def run_jobs(gateways: list[str], jobs: int, clients: int, steps: int, tag: str, size=(32, 64)) -> tuple[list, float]:
    """`jobs` jobs from `clients` threads, job i on gateway i mod len(gateways); their ids and the seconds from the
    first submit to the last end."""
    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        ids = list(
            pool.map(
                lambda i: _submit_and_follow(gateways[i % len(gateways)], _request(tag, i, steps, *size)), range(jobs)
            )
        )
    return ids, time.perf_counter() - started


def count(store_location: str, job_ids: list[str]) -> LoadCounts:
    """How the jobs ended, read from the store (a postgresql:// URL or a SQLite file)."""

    async def read(store):
        succeeded = lost = double = 0
        for job_id in job_ids:
            job = await store.get_job(job_id)
            if job is None or job.state != S.JOB_STATE_SUCCEEDED:
                lost += 1
                continue
            succeeded += 1
            events = await store.events(job_id)
            in_order = [e.seq for e in events] == list(range(1, job.last_event_seq + 1))
            ends = sum(map(is_terminal, events))
            double += not (in_order and ends == 1 and len(job.artifacts) == 1)
        return LoadCounts(len(job_ids), succeeded, lost, double)

    return Backend("postgresql" if store_location.startswith("postgres") else "sqlite", store_location).run(read)


def load(gateways: list[str], store_location: str, jobs: int, clients: int, steps: int, tag: str) -> LoadCounts:
    """The load run on running gateways: the jobs, then their counts from the store."""
    ids, _ = run_jobs(gateways, jobs, clients, steps, tag)
    return count(store_location, ids)


def _gateway_config(base: Path, root: Path, name: str, store_url: str) -> Path:
    """`base`'s deployment with a gateway of its own: its port, data_dir and store."""
    data = tomllib.loads(base.read_text())
    data["gateway"].update(port=free_port(), data_dir=str(root / name), store_url=store_url)
    path = root / f"{name}.toml"
    path.write_text(dumps(data))
    return path


def _measure(args, root: Path, base: Path, stores: dict[str, str]) -> tuple[float, float, float]:
    """(two gateways on PostgreSQL, one on PostgreSQL, one on SQLite): seconds for the same number of jobs."""
    seconds = {}
    runs = {"two-pg": (stores["two"], 2), "one-pg": (stores["one"], 1), "one-sqlite": ("", 1)}
    for tag, (store_url, count_of) in runs.items():
        configs = [_gateway_config(base, root, f"{tag}-{i}", store_url) for i in range(count_of)]
        with contextlib.ExitStack() as running:
            for config in configs:
                running.enter_context(
                    ServiceGroup(load_deploy(config), str(config), str(root / tag), ("gateway",), is_answering)
                )
            addresses = [f"127.0.0.1:{load_deploy(c).gateway.port}" for c in configs]
            print(f"{tag}: {args.jobs} jobs from {args.clients} clients on {len(addresses)} gateway(s)", flush=True)
            ids, seconds[tag] = run_jobs(addresses, args.jobs, args.clients, args.steps, tag, (args.height, args.width))
            counts = count(store_url or str(root / f"{tag}-0" / "jobs.sqlite"), ids)
            print(f"{tag}: {seconds[tag]:.1f} s, {counts}", flush=True)
            if counts != LoadCounts(args.jobs, args.jobs, 0, 0):
                raise SystemExit(f"{tag}: {counts}")
    return seconds["two-pg"], seconds["one-pg"], seconds["one-sqlite"]


def measure(args) -> tuple[float, float, float]:
    with tempfile.TemporaryDirectory(prefix="h3serve-two-gateways-") as tmp, start_postgres() as postgres:
        root = Path(tmp)
        base = tiny_deployment(root)
        stores = {name: postgres.new_database() for name in ("two", "one")}
        with ServiceGroup(load_deploy(base), str(base), log_dir=str(root), names=MODEL_SERVICES):
            return _measure(args, root, base, stores)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--height", type=int, default=32)
    parser.add_argument("--width", type=int, default=64)
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # as a Ctrl-C: PostgreSQL and the services stop too
    two, one_pg, one_sqlite = measure(args)
    print(
        f"| store | gateways | {args.jobs} jobs, {args.clients} clients | jobs/s |\n|---|---|---|---|\n"
        f"| PostgreSQL | 2 | {two:.1f} s | {args.jobs / two:.2f} |\n"
        f"| PostgreSQL | 1 | {one_pg:.1f} s | {args.jobs / one_pg:.2f} |\n"
        f"| SQLite | 1 | {one_sqlite:.1f} s | {args.jobs / one_sqlite:.2f} |"
    )
    if args.write:
        name = f"submit_to_finish_{args.height}x{args.width}x{args.steps}steps_{args.jobs}jobs_{args.clients}clients"
        compared = [  # (seconds, its variant, the baseline's seconds, the baseline)
            (two, "2 gateways, PostgreSQL (0 lost, 0 double commits)", one_pg, "1 gateway, PostgreSQL"),
            (one_pg, "1 gateway, PostgreSQL", one_sqlite, "1 gateway, SQLite"),
        ]
        records = [
            cpu_record(
                "bench.two_gateways",
                argv,
                name=name,
                seconds=seconds,
                baseline_seconds=base,
                ratio=base / seconds,
                peak_gib=0.0,
                variant=variant,
                baseline=baseline,
            )
            for seconds, variant, base, baseline in compared
        ]
        update_results(records, args.results, args.markdown)


if __name__ == "__main__":
    main()
