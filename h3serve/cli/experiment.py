"""`h3serve experiment run | model | report`: per-stage scaling experiments (docs/experiments.md).

`run` drives a running deployment (or a sweep of deployments, started here with h3serve's launcher) through the
public API and writes the raw data and the report; `report` renders the report again from the raw data; `model`
predicts other replica counts and rates from a measured run. h3serve/cli/main.py assembles them with
`add_parser`. Heavy imports (matplotlib, simpy, grpc) wait until a command runs.
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import asdict
from pathlib import Path

from h3serve.common.config import SERVICES, DeployConfig, load_deploy


def _replica_groups(entry, deploy: DeployConfig, folder: Path) -> list:
    """One ServiceGroup per process of a sweep configuration: every replica address its [gateway] lists for each
    model service (the section's own address with the section's settings, any other with its host and port as
    flags, each with its `gpus` entry), then the gateway on a fresh data directory in `folder`."""
    from h3serve.cli.launcher import START_ORDER, ServiceGroup

    logs, groups, own = folder / "logs", [], {}
    for service in SERVICES:
        section = deploy.service(service)
        for number, address in enumerate(deploy.gateway.replicas(service)):
            gpus = entry.gpus[service][number] if service in entry.gpus else section.gpus
            if address == section.address:
                own[service] = section.replace(gpus=gpus)
                continue
            host, _, port = address.rpartition(":")
            replica = deploy.replace(**{service: section.replace(host=host, port=int(port), gpus=gpus)})
            groups.append(
                ServiceGroup(
                    replica,
                    entry.deploy,
                    str(logs / f"{service}-{port}"),
                    names=(service,),
                    flags={service: ["--host", host, "--port", port]},
                )
            )
    main = deploy.replace(**own)
    names = tuple(name for name in START_ORDER if name == "gateway" or name in own)
    groups.append(
        ServiceGroup(
            main, entry.deploy, str(logs), names=names, flags={"gateway": ["--data-dir", str(folder / "gateway-data")]}
        )
    )
    return groups


@contextlib.contextmanager
def _started(entry, deploy: DeployConfig, folder: Path):
    """A sweep configuration's processes, healthy, for the duration of its experiment; stopped after."""
    with contextlib.ExitStack() as stack:
        for group in _replica_groups(entry, deploy, folder):  # the extra replicas first, the gateway last
            stack.enter_context(group)
        yield


def _run(args) -> None:
    import grpc

    from h3serve.experiment.driver import ExperimentError

    if not (args.sweep and not (args.config or args.load) or not args.sweep and args.config and args.load):
        raise SystemExit("h3serve experiment run: give --config and --load, or --sweep")
    stream = None if args.quiet else sys.stderr
    try:
        if args.sweep:
            from h3serve.experiment.sweep import check_sweep, run_sweep

            path = run_sweep(check_sweep(args.sweep), Path(args.out), _started, stream)
        else:
            from h3serve.experiment.loadspec import load_spec
            from h3serve.experiment.runner import Target, run_experiment

            target = Target.of(load_deploy(args.config).gateway)
            path = run_experiment(target, load_spec(args.load), Path(args.out), stream)
    except ExperimentError as exc:
        raise SystemExit(f"h3serve experiment: {exc}") from None
    except grpc.RpcError as exc:
        raise SystemExit(f"h3serve experiment: the gateway: {exc.code().name}: {exc.details()}") from None
    print(path.resolve())


def _readable(folder: str, command: str) -> Path:
    """A run's directory, or the command's one-line refusal."""
    path = Path(folder)
    missing = [name for name in ("run.json", "jobs.csv", "stage_records.csv") if not (path / name).is_file()]
    if missing:
        raise SystemExit(f"h3serve experiment {command}: {folder} is not a recorded run (no {', '.join(missing)})")
    return path


def _report(args) -> None:
    from h3serve.experiment.report import render

    print(render(_readable(args.folder, "report")).resolve())


def _describe_prediction(prediction, replicas: dict[str, int], load: str) -> str:
    latency = "  ".join(f"{k} {v:.2f} s" for k, v in prediction.latency_s.items())
    busy = "  ".join(f"{stage} {value:.2f}" for stage, value in prediction.utilisation.items())
    lines = [
        f"predicted at {', '.join(f'{k}={v}' for k, v in replicas.items())}, {load}:",
        f"  latency      {latency}",
        f"  utilisation  {busy}",
        f"  throughput   {prediction.throughput_per_s:.3f} jobs/s",
        f"  largest sustainable rate {prediction.max_rate:.3f} jobs/s ({prediction.bottleneck} reaches utilisation 1)",
    ]
    return "\n".join(lines + [f"  not measured: {note}" for note in prediction.unmeasured])


def _overload(rate: float | None, prediction) -> str:
    if rate and rate >= prediction.max_rate:
        return (
            f"  overloaded: {rate:g} jobs/s is at or above the largest sustainable rate; the queue grows for as "
            f"long as the arrivals go on, so the latency printed is that of a run of --jobs jobs only\n"
        )
    return ""


def _model(args) -> None:
    from h3serve.experiment.analysis import Run
    from h3serve.experiment.model import Load, Profile, by_rate, check, parse_replicas, simulate

    try:
        profile = Profile.measure(Run.read(_readable(args.source, "model")))
        replicas = parse_replicas(args.replicas, profile.replicas)
    except ValueError as exc:  # a run without a finished job, or a bad --replicas
        raise SystemExit(f"h3serve experiment model: {exc}") from None
    load = Load(args.rate, args.concurrency)
    prediction = simulate(profile, replicas, load, args.jobs, args.runs, args.seed)
    errors = check(prediction, _readable(args.check, "model")) if args.check else None
    if args.json:
        print(
            json.dumps(
                {
                    "replicas": replicas,
                    "load": load.describe(profile),
                    **asdict(prediction),
                    "speeds": profile.speeds,
                    "error": errors,
                },
                indent=1,
            )
        )
        return
    print(
        f"measured: {profile.label} ({', '.join(f'{k}={v}' for k, v in profile.replicas.items())}, "
        f"{len(profile.sequence)} jobs); speed per calls at once: "
        + "; ".join(f"{stage} {', '.join(f'{s:.2f}' for s in speeds)}" for stage, speeds in profile.speeds.items())
    )
    print(_describe_prediction(prediction, replicas, f"{load.describe(profile)}, {args.runs} simulated runs"))
    print(_overload(args.rate, prediction), end="")
    print(
        "  p95 by Poisson rate: "
        + "  ".join(f"{rate:.3g}/s {p.latency_s['p95']:.2f} s" for rate, p in by_rate(profile, replicas, args.seed))
    )
    if errors:
        print(
            f"against {args.check}: "
            + "  ".join(f"{k} measured {m:.3f} s, predicted {p:.3f} s ({e:+.1%})" for k, (m, p, e) in errors.items())
        )


def add_parser(subparsers) -> None:
    """Register `h3serve experiment run|model|report` on the h3serve command's subparsers."""
    p = subparsers.add_parser("experiment", help="per-stage scaling experiments: drive a load, report, model")
    sub = p.add_subparsers(dest="experiment", required=True)

    r = sub.add_parser("run", help="drive a running deployment with a load (or a sweep of deployments); report")
    r.add_argument("--config", help="deployment TOML: its [gateway] gives the address, metrics port, TLS, token")
    r.add_argument("--load", help="load TOML: arrivals, bounds, the mix (docs/experiments.md)")
    r.add_argument(
        "--sweep",
        help="sweep TOML: several deployments (started here or running) under one load, "
        "overlaid in one report; instead of --config and --load",
    )
    r.add_argument("--out", required=True, help="directory for the raw data and the report (created)")
    r.add_argument("--quiet", action="store_true", help="no live progress line")
    r.set_defaults(run=_run)

    m = sub.add_parser(
        "model",
        help="predict latency, utilisation and the largest sustainable rate at other "
        "replica counts and rates, from a measured run (a simpy simulation)",
    )
    m.add_argument("--from", dest="source", required=True, metavar="DIR", help="a measured run's directory")
    m.add_argument("--replicas", default="", help="e.g. encoder=1,dit=2,vae=1 (default: the measured ones)")
    arrivals = m.add_mutually_exclusive_group()
    arrivals.add_argument("--rate", type=float, help="Poisson arrivals, jobs/s (default: the run's own arrivals)")
    arrivals.add_argument("--concurrency", type=int, help="a closed loop of this many clients")
    m.add_argument("--jobs", type=int, help="jobs per simulated run (default: as many as measured)")
    m.add_argument("--runs", type=int, default=200, help="simulated runs pooled into the prediction")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument(
        "--check",
        metavar="DIR",
        help="a measured run of the predicted configuration: print the prediction's error against it",
    )
    m.add_argument("--json", action="store_true", help="print the prediction as JSON")
    m.set_defaults(run=_model)

    p = sub.add_parser("report", help="render a run's report again from its raw data")
    p.add_argument("folder", metavar="DIR")
    p.set_defaults(run=_report)
