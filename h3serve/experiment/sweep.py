"""Several configurations measured one after another under the same load, overlaid in one report.

    load = "tiny-mix.toml"        # every configuration's load (a configuration may name its own)
    [[config]]
    name = "vae-1"                # the folder of its report under the output directory
    deploy = "deploy-vae1.toml"
    start = true                  # start it for the run (every replica its [gateway] section lists), stop it after;
                                  # false: a deployment that is running already
    [config.gpus]                 # optional: CUDA_VISIBLE_DEVICES of each started replica, in [gateway] order
    dit = ["1", "2"]

Starting processes is the CLI's (h3serve/cli/experiment.py): this package is a client of the public API only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Annotated, Literal, TextIO

from pydantic import Field, ValidationInfo, field_validator, model_validator

from h3serve.common.config import ConfigError, DeployConfig, load_deploy
from h3serve.experiment.loadspec import Spec, existing, load_spec, read_checked
from h3serve.experiment.report import render_overlay
from h3serve.experiment.runner import Target, run_experiment


class Configuration(Spec):
    name: str = Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")
    deploy: str
    start: bool = True
    gpus: dict[Literal["encoder", "dit", "vae"], Annotated[tuple[str, ...], Field(strict=False)]] = Field(
        default_factory=dict
    )
    load: str = ""

    _files_exist = field_validator("deploy", "load")(existing)


class Sweep(Spec):
    load: str = ""
    config: tuple[Configuration, ...] = Field(strict=False)

    _load_exists = field_validator("load")(existing)

    @model_validator(mode="after")
    def _complete(self, info: ValidationInfo) -> Sweep:
        names = [entry.name for entry in self.config]
        if not names:
            raise ValueError("at least one [[config]] is required")
        if len(set(names)) < len(names):
            raise ValueError(f"config names must differ: {', '.join(names)}")
        if not self.load and not all(entry.load for entry in self.config):
            raise ValueError("give a load: at the top for every configuration, or in each [[config]]")
        return self


Starter = Callable[[Configuration, DeployConfig, Path], AbstractContextManager]


def check_sweep(path: str | Path) -> Sweep:
    """Read the sweep file, then every deploy and load file it names, before anything starts (ConfigError)."""
    sweep = read_checked(path, Sweep)
    for entry in sweep.config:
        deploy = load_deploy(entry.deploy)
        load_spec(entry.load or sweep.load)
        for service, gpus in entry.gpus.items():
            if len(gpus) != len(deploy.gateway.replicas(service)):
                raise ConfigError(
                    f"{path} config {entry.name} gpus.{service}: {len(gpus)} entries for "
                    f"{len(deploy.gateway.replicas(service))} replicas"
                )
    return sweep


def run_sweep(sweep: Sweep, out: Path, start: Starter, stream: TextIO | None) -> Path:
    """Each configuration's experiment into out/<name>/, then the overlay into out/report.html."""
    folders = []
    for entry in sweep.config:
        deploy, folder = load_deploy(entry.deploy), out / entry.name
        if stream:
            print(f"{entry.name}: {'starting ' if entry.start else ''}{entry.deploy}", file=stream, flush=True)
        with start(entry, deploy, folder) if entry.start else contextlib.nullcontext():
            run_experiment(Target.of(deploy.gateway), load_spec(entry.load or sweep.load), folder, stream, entry.name)
        folders.append(folder)
    return render_overlay(folders, out)
