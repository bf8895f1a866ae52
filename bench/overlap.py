"""What the stage overlap buys: K jobs one after another vs K jobs submitted at once, same stack.

Starts encoder, DiT, VAE and gateway with the tiny model on CPU (the demo deployment's settings, one
thread each: bench/deployment.py), runs K jobs serially (each submitted when the previous one is done) and then
K jobs submitted together, so the gateway pipelines them (encoder k+1 / DiT k / VAE k-1). Prints a table; --write
adds the rows to bench/results.json and BENCHMARKS.md (ratio = serial seconds / pipelined seconds).

    python -m bench.overlap [--jobs 4] [--height 64 --width 128 --steps 16] [--write]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench.deployment import add_request_arguments, cpu_record, tiny_deployment
from bench.results import add_output_arguments, update_results
from h3serve.cli.launcher import ServiceGroup
from h3serve.client import GatewayClient
from h3serve.common.config import load_deploy
from h3serve.v1 import common_pb2, gateway_pb2


def _requests(args, tag: str) -> list[gateway_pb2.GenerateRequest]:
    # Distinct prompts: every job pays its encode (no cache hit helps one mode over the other).
    return [
        gateway_pb2.GenerateRequest(
            prompt=f"overlap bench {tag} {i}",
            height=args.height,
            width=args.width,
            params=common_pb2.GenerationParams(num_inference_steps=args.steps, seed=i),
        )
        for i in range(args.jobs)
    ]


def _serial(client: GatewayClient, requests) -> float:
    started = time.perf_counter()
    for request in requests:
        assert client.generate(request).HasField("done")
    return time.perf_counter() - started


def _pipelined(client: GatewayClient, requests) -> float:
    started = time.perf_counter()
    jobs = [client.stub.Submit(request) for request in requests]
    for job in jobs:
        events = list(client.stub.Watch(gateway_pb2.WatchRequest(job_id=job.job_id)))
        assert events[-1].HasField("done"), events[-1]
    return time.perf_counter() - started


def measure(args) -> tuple[float, float]:
    with tempfile.TemporaryDirectory(prefix="h3serve-overlap-") as tmp:
        root = Path(tmp)
        config = tiny_deployment(root)
        deploy = load_deploy(config)
        with ServiceGroup(deploy, str(config), log_dir=str(root)):
            client = GatewayClient(f"127.0.0.1:{deploy.gateway.port}")
            try:
                _serial(client, _requests(args, "warm-up")[:1])
                serial = min(_serial(client, _requests(args, f"serial {r}")) for r in range(args.repeats))
                pipelined = min(_pipelined(client, _requests(args, f"pipelined {r}")) for r in range(args.repeats))
            finally:
                client.close()
    return serial, pipelined


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=4)
    add_request_arguments(parser, steps=16)
    parser.add_argument("--repeats", type=int, default=2, help="best of this many runs per mode")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    serial, pipelined = measure(args)
    name = f"gateway_overlap_{args.height}x{args.width}x{args.steps}steps_{args.jobs}jobs"
    print(
        f"| mode | {args.jobs} jobs, {args.height}x{args.width}, {args.steps} steps | per job |\n|---|---|---|\n"
        f"| serial (submit after done) | {serial:.2f} s | {serial / args.jobs:.2f} s |\n"
        f"| pipelined (submit all) | {pipelined:.2f} s | {pipelined / args.jobs:.2f} s |\n"
        f"speed-up: {serial / pipelined:.2f}x"
    )
    if args.write:
        record = cpu_record(
            "bench.overlap",
            argv,
            name=name,
            seconds=pipelined,
            baseline_seconds=serial,
            ratio=serial / pipelined,
            peak_gib=0.0,
            variant="pipelined stages",
            baseline="same jobs, serial",
        )
        update_results([record], args.results, args.markdown)


if __name__ == "__main__":
    main()
