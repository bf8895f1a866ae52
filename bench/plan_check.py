"""`h3serve plan` against what the GPUs measured: every shipped profile's served rows in bench/results.json.

For each end-to-end row of a shipped deployment (`--deploy docs/deploy/X.toml`) whose profile is still planned as the
one it served on the row's date (git history; a setting the plan does not read leaves its rows in), the deployment
bench.e2e served is built again from the row's own command (the profile with the bench's changes: random weights, the
request's LoRA, warm-up sizes, one GPU), planned by `h3serve.common.memory_plan.plan` for the row's canvas and frames,
and set beside the row's peaks: all processes together on the fullest GPU (nvidia-smi, sampled while they ran) and
each process's own (its allocator's peak: the DiT's ranks and the encoder and VAE). The issue's bar is every profile's
planned peak within 10 % of a measured one. Nothing is run on a GPU; the table is reproducible from the committed rows.

    python -m bench.plan_check            # the markdown table docs/memory-plan.md shows
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import shlex
import subprocess
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

from bench import e2e
from bench.common import Size
from bench.deployment import profile_deployment
from bench.served import profile_changes
from h3serve.common import memory_plan
from h3serve.common.config import load_deploy

DEPLOYMENT = re.compile(r"deployment (docs/deploy/\S+\.toml)")
STAGE_ROWS = ("_encode", "_denoise", "_decode", "_mux", "_transport", "_first_request", "_start_to_ready")
BAR = 0.10  # the bound on |planned - measured| / measured


@dataclass(frozen=True)
class Check:
    """One measured row beside its plan."""

    date: str
    profile: str
    size: Size
    device: str
    variant: str
    measured: float  # all processes on the fullest GPU, GiB
    planned: float  # the plan's GPU 0 (the one every profile's DiT rank 0 shares with the others)
    measured_parts: dict[str, float]
    planned_parts: dict[str, float]

    @property
    def plan(self) -> tuple[float, dict[str, float]]:
        return self.planned, self.planned_parts

    @property
    def off(self) -> float:
        return (self.planned - self.measured) / self.measured

    def row(self) -> str:
        parts = ", ".join(
            f"{name} {self.planned_parts[name]:.1f} / {self.measured_parts[name]:.1f}"
            for name in self.planned_parts
            if name in self.measured_parts
        )
        return (
            f"| {self.date} | `{Path(self.profile).name}` | {self.size} | {self.device} | {self.variant} | "
            f"{self.planned:.1f} | {self.measured:.1f} | {self.off:+.1%} | {parts} |"
        )


def served_rows(records: list[dict]) -> list[dict]:
    """The end-to-end rows of shipped deployments measured on a GPU, the newest per profile, size and variant."""
    newest = {}
    for r in records:
        if not r["name"].startswith("e2e_") or r["name"].endswith(STAGE_ROWS) or not r["peak_gib"]:
            continue
        if DEPLOYMENT.search(r["variant"]) and r["device"] != "cpu":
            newest[(r["name"], r["device"], r["variant"])] = r
    return list(newest.values())


def profile_then(profile: str, date: str) -> str | None:
    """`profile`'s text at the end of `date` (git history); None where git cannot say (no history)."""
    try:
        commit = subprocess.run(
            ["git", "rev-list", "-1", f"--before={date} 23:59:59", "HEAD", "--", profile],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        then = subprocess.run(["git", "show", f"{commit}:{profile}"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return then.stdout if commit else None


def planned_as_served(record: dict, today: Check, work: Path) -> bool | None:
    """Whether today's profile plans the row's request (`today`) as the profile it served on its date did (a setting
    the plan does not read, such as a cache directory, leaves its rows in); None where git cannot say."""
    profile = DEPLOYMENT.search(record["variant"]).group(1)
    text = profile_then(profile, record["date"])
    if text is None:
        return None
    if tomllib.loads(text) == tomllib.loads(Path(profile).read_text()):
        return True
    then = work / "profile-then.toml"
    then.write_text(text)
    served = check(record, work, then)
    return served is not None and today.plan == served.plan


def bench_arguments(command: str) -> argparse.Namespace:
    """bench.e2e's arguments of the services call in a row's command (a row may name the baseline's call first)."""
    calls = [c for c in command.split(";") if "--deploy" in c]
    words = shlex.split(calls[-1].split("(")[0])
    return e2e.parser().parse_args(words[words.index("bench.e2e") + 1 :])


@functools.cache
def lora_bytes(rank: int) -> int:
    """What bench.adapters.write_lora's file of `rank` weighs (bf16 factors on each of its targets), counted on a
    weightless transformer."""
    import torch

    from bench.adapters import lora_targets
    from bench.dit_step import components

    model = components(False, "meta", torch.bfloat16)["transformer"]
    return sum(2 * rank * (m.in_features + m.out_features) for _, m in lora_targets(model))


def check(record: dict, work: Path, profile: Path | None = None) -> Check | None:
    """The row beside its plan (of `profile`, by default the row's own profile as it is today); None where the row's
    deployment named a file this machine lacks (a GGUF)."""
    args = bench_arguments(record["command"])
    if args.transformer_file and not Path(args.transformer_file).exists():
        return None
    if args.adapter_rank:  # the plan counts the adapter by its file's size: a sparse file of that size
        args.adapter_file = str(work / f"lora-{args.adapter_rank}.safetensors")
        with open(args.adapter_file, "wb") as sparse:
            sparse.truncate(lora_bytes(args.adapter_rank))
    size = Size.parse(record["name"].split("_")[1])
    deploy = profile_deployment(profile or Path(args.deploy), profile_changes(args, work), work / "deploy.toml")
    config = load_deploy(deploy)
    gpu = memory_plan.plan(config, canvas=(size.height, size.width), frames=size.frames).gpus[0]
    planned = {share.process.split()[0]: share.total for share in gpu.shares}
    ranks = record.get("rank_peaks_gib") or []
    measured = {**(record.get("process_peaks_gib") or {}), **({"dit": max(ranks)} if ranks else {})}
    variant = DEPLOYMENT.sub("", record["variant"]).removeprefix("gRPC services, ").strip(" ,")
    return Check(
        record["date"], args.deploy, size, record["device"], variant, record["peak_gib"], gpu.used, measured, planned
    )


def table(checks: list[Check]) -> str:
    head = (
        "| date | profile | request | device | as served | planned GPU 0 GiB | measured GiB (all processes) | "
        "planned - measured | per process, planned / measured GiB |\n|---|---|---|---|---|---|---|---|---|"
    )
    return "\n".join([head, *(c.row() for c in checks)])


def main(argv: list[str] | None = None) -> list[Check]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default="bench/results.json")
    args = p.parse_args(argv)
    rows = served_rows(json.loads(Path(args.results).read_text()))
    with tempfile.TemporaryDirectory(prefix="h3serve-plan-check-") as scratch:
        work = Path(scratch)
        planned = [(r, check(r, work)) for r in rows]
        checks = [c for r, c in planned if c is not None and planned_as_served(r, c, work) is not False]
    lacking = sum(c is None for _, c in planned)
    print(table(checks))
    print(
        f"\nleft out: {len(rows) - lacking - len(checks)} row(s) of a profile whose plan changed since, "
        f"{lacking} whose deployment named a file this machine lacks (a GGUF)"
    )
    within = sum(abs(c.off) <= BAR for c in checks)
    print(f"\n{within} of {len(checks)} within {BAR:.0%} of the measured peak")
    return checks


if __name__ == "__main__":
    main()
