"""Reading a deployment file and command-line flags into a checked `DeployConfig`, and the refusal (`ConfigError`)
with one line per problem, naming the file, the section and the key."""

from __future__ import annotations

import difflib
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from pydantic import ValidationError

from h3serve.common.config.base import Section
from h3serve.common.config.deploy import SECTION_MODELS, SECTIONS, SERVICES, DeployConfig
from h3serve.common.config.model import ModelSection

if TYPE_CHECKING:  # pydantic's own dependency; read by the type checker only
    from pydantic_core import ErrorDetails


class ConfigError(ValueError):
    """A refused deployment file or flag; the message has one line per problem."""


def load_deploy(path: str | Path | None) -> DeployConfig:
    """Read a deployment file. `[model] dir` is the default model_dir of every model service; a stage address the
    gateway does not name is that service's host:port. ConfigError (a ValueError) lists what is wrong."""
    config = DeployConfig()
    if path is None:
        return config
    tables = _tables(path)
    shared = _checked(ModelSection(), tables["model"], f"{path} [model]").shared()
    services = {
        name: _checked(config.service(name), {**shared, **tables[name]}, f"{path} [{name}]") for name in SERVICES
    }
    stages = {name: service.address for name, service in services.items()}
    gateway = _checked(
        config.gateway, {**shared, **stages, **tables["gateway"], "deploy_file": str(path)}, f"{path} [gateway]"
    )
    supervisor = _checked(config.supervisor, tables["supervisor"], f"{path} [supervisor]")
    deploy = DeployConfig(gateway=gateway, supervisor=supervisor, **services)
    problems = _gateway_within_services(deploy)
    if problems:
        raise ConfigError("\n".join(f"{path} {problem}" for problem in problems))
    return deploy


# (gateway key, service, service key): the gateway admits what the service then checks again
SHARED_LIMITS = (
    ("max_prompt_chars", "encoder", "max_prompt_chars"),
    ("max_steps", "dit", "max_steps"),
    ("max_rows", "dit", "max_rows"),
)


def _gateway_within_services(deploy: DeployConfig) -> list[str]:
    """A gateway limit above its service's would accept requests the service refuses after they waited in a queue."""
    return [
        f"[gateway] {key} = {getattr(deploy.gateway, key):,} is above [{service}] {own} = "
        f"{getattr(deploy.service(service), own):,}: requests it admits would be refused by the {service}; lower "
        f"the gateway's or raise the {service}'s"
        for key, service, own in SHARED_LIMITS
        if getattr(deploy.gateway, key) > getattr(deploy.service(service), own)
    ]


def override(section, **flags):
    """Apply command-line flags that were given (not None) to one config section, checked like the file."""
    return _checked(section, {k: v for k, v in flags.items() if v is not None}, "command line")


def _tables(path: str | Path) -> dict[str, dict]:
    """Every known section of the file as a table ({} when absent); unknown sections are refused."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    problems = [
        f"{path} [{name}]: unknown section; known: {', '.join(SECTIONS)}" for name in data if name not in SECTIONS
    ]
    problems += [f"{path} [{name}]: should be a table" for name in SECTIONS if not isinstance(data.get(name, {}), dict)]
    if problems:
        raise ConfigError("\n".join(problems))
    return {name: data.get(name, {}) for name in SECTIONS}


S = TypeVar("S", bound=Section)


def _checked(section: S, changes: dict, where: str) -> S:
    try:
        return section.replace(**changes)
    except ValidationError as error:
        raise ConfigError(
            "\n".join(f"{where} {_describe(problem, type(section))}" for problem in error.errors())
        ) from None


def _describe(problem: ErrorDetails, model: type[Section]) -> str:
    """`key: what is wrong`, the key dotted into tables and lists ("capacity.t2va.768x1344", "workflows.0")."""
    key = ".".join(str(part) for part in problem["loc"] if part != "[key]")
    if problem["type"] == "extra_forbidden":
        owners = [
            f"[{name}]"
            for name, section in SECTION_MODELS.items()
            if section is not model and str(problem["loc"][-1]) in section.model_fields
        ]
        if owners and len(problem["loc"]) == 1:
            return f"{key}: not a key of this section; it belongs in {' or '.join(owners)}"
        close = difflib.get_close_matches(str(problem["loc"][-1]), model.model_fields, n=1)
        return f"{key}: unknown key" + (f"; did you mean {close[0]}?" if close else "")
    if problem["type"] == "value_error":  # our own checks: the message says it all
        return f"{key}: {problem['msg'].removeprefix('Value error, ')}"
    return f"{key}: {problem['msg']} (got {problem['input']!r})"
