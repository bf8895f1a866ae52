"""Installs that fit the host (pyproject.toml): a plain `pip install` carries the gateway, the client and the CLI's
torch-free commands; the `model` extra adds the model services, `experiment` the experiment tool, `dev` the
stub generator that `make proto` runs.

The fast checks parse every import under h3serve/ (module level and inside functions) and map each top-level
name to the distribution that installs it (importlib.metadata.packages_distributions()); the slow one installs the
project with no extras into a fresh venv and starts the gateway's code there.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "h3serve"
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]

# Imported directly but installed by a declared dependency, which pins it (the check below reads that it does).
VIA = {"starlette": "fastapi", "tokenizers": "transformers"}
# What a gateway host never installs.
NOT_ON_A_GATEWAY = {
    "torch",
    "torchvision",
    "torchaudio",
    "diffusers",
    "accelerate",
    "torchao",
    "peft",
    "simpy",
    "matplotlib",
    "grpcio-tools",
}


def names(*groups: str) -> set[str]:
    """The distributions the groups require ("" = the base dependencies)."""
    requirements = [r for g in groups for r in (EXTRAS[g] if g else PROJECT["dependencies"])]
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def imports(path: Path) -> tuple[set[str], set[str]]:
    """The third-party top-level names `path` imports: (at module level, inside functions). What only a type
    checker reads (`if TYPE_CHECKING:`) never runs, and is left out."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(getattr(node, "body", None), list):
            node.body = [child for child in node.body if not _type_checking_only(child)]
    everywhere, top = set(), set()

    def found(node) -> list[str]:
        if isinstance(node, ast.Import):
            return [alias.name for alias in node.names]
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            return [node.module]
        return []

    def module_level(node):
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                top.update(found(child))
                module_level(child)

    module_level(tree)
    for node in ast.walk(tree):
        everywhere.update(found(node))
    third_party = {n.split(".")[0] for n in everywhere} - set(sys.stdlib_module_names) - {"h3serve", "__future__"}
    top = {n.split(".")[0] for n in top} & third_party
    return top, third_party - top


def _type_checking_only(node) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def local_kernel_modules() -> set[str]:
    """The modules of the optional attention kernels (runtime/kernels/local.py's LocalKernel(module, package, ...)):
    each names its package and is checked when its backend is configured, so no extra installs it."""
    tree = ast.parse((PACKAGE / "runtime" / "kernels" / "local.py").read_text())
    return {
        node.args[0].value.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", "") == "LocalKernel"
        and isinstance(node.args[0], ast.Constant)
    }


DISTRIBUTIONS = importlib.metadata.packages_distributions()


def missing(top_names: set[str], allowed: set[str]) -> set[str]:
    """The names no distribution in `allowed` installs (a name not installed here is taken as its own distribution)."""

    def provided(name: str) -> bool:
        dists = {canonicalize_name(d) for d in DISTRIBUTIONS.get(name, [name])}
        return bool(dists & allowed) or VIA.get(name) in allowed

    return {name for name in top_names if not provided(name)}


def files(*packages: str) -> list[Path]:
    return [path for package in packages for path in sorted((PACKAGE / package).rglob("*.py"))]


def imports_of(*packages: str) -> set[str]:
    return set().union(*(set().union(*imports(path)) for path in files(*packages)))


def check(
    paths: list[Path], module_groups: tuple[str, ...], function_groups: tuple[str, ...], extra: set[str] = frozenset()
) -> list[str]:
    """What `paths` import that their groups do not install: at module level `module_groups`, inside functions
    those and `function_groups` ("" = the base); `extra`: names taken as provided."""

    def label(groups):
        return " + ".join(g or "base" for g in groups)

    wrong = []
    for path in paths:
        top, inside = imports(path)
        rel = path.relative_to(ROOT)
        for name in sorted(missing(top - extra, names(*module_groups))):
            wrong.append(f"{rel} imports {name} at module level: not in {label(module_groups)}")
        for name in sorted(missing(inside - extra, names(*module_groups, *function_groups))):
            wrong.append(f"{rel} imports {name} in a function: not in {label((*module_groups, *function_groups))}")
    return wrong


def test_the_gateway_the_client_and_their_layers_import_only_the_base():
    """v1, model, common, client, gateway: everything a gateway host runs. h3serve/model/workflows' stage-side
    methods import diffusers when called (inside the services), so their functions may use the `model` extra; the
    PostgreSQL job store (gateway/jobs/postgres/, imported only when a store_url names it) is the `postgres` extra."""
    workflows, postgres = PACKAGE / "model" / "workflows", PACKAGE / "gateway" / "jobs" / "postgres"
    paths = files("v1", "model", "common", "client", "gateway")
    base = [p for p in paths if workflows not in p.parents and postgres not in p.parents]
    wrong = check(base, ("",), ())
    wrong += check([p for p in paths if workflows in p.parents], ("",), ("model",))
    wrong += check([p for p in paths if postgres in p.parents], ("", "postgres"), ())
    assert not wrong, "\n".join(wrong)


def loaded_at_start(path: Path) -> set[Path]:
    """`path` and the h3serve modules it imports at module level, transitively."""
    seen, todo = set(), [path]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for node in ast.iter_child_nodes(ast.parse(current.read_text())):
            modules = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            for module in modules:
                if module.split(".")[0] == "h3serve":
                    base = ROOT / module.replace(".", "/")
                    todo += [p for p in (base.with_suffix(".py"), base / "__init__.py") if p.exists()]
    return seen


def test_the_cli_starts_on_the_base_and_its_commands_use_their_extras():
    """`h3serve` loads on a gateway host: what its entry point imports at start takes the base; the commands
    (`reference`, `up`, `experiment`...) import what they need when run, from their extras."""
    start = loaded_at_start(PACKAGE / "cli" / "main.py")
    assert PACKAGE / "cli" / "plan.py" in start and PACKAGE / "cli" / "reference.py" not in start, start
    wrong = check(sorted(start), ("",), ("model", "experiment"))
    wrong += check([p for p in files("cli") if p not in start], ("", "model", "experiment"), ())
    assert not wrong, "\n".join(wrong)


def test_the_model_services_need_the_model_extra():
    kernels = local_kernel_modules()
    assert {"cudnn", "flash_attn", "cuda"} <= kernels, kernels
    wrong = check(files("runtime", "services"), ("", "model", "gpu"), (), extra=kernels)
    assert not wrong, "\n".join(wrong)


def test_the_experiment_tool_needs_the_experiment_extra():
    wrong = check(files("experiment"), ("", "experiment"), ())
    assert not wrong, "\n".join(wrong)
    assert {"simpy", "matplotlib"} <= imports_of("experiment"), "the check sees the tool's imports"


def test_the_checks_see_every_package_and_the_imports_that_matter():
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("__")}
    assert packages == {"v1", "model", "common", "client", "gateway", "cli", "runtime", "services", "experiment"}, (
        "a new package needs its place in these checks"
    )
    gateway = imports_of("gateway")
    assert {"grpc", "fastapi", "PIL", "av", "transformers"} <= gateway, gateway
    assert {"torch", "diffusers"} <= imports_of("services"), "the check sees the services' imports"
    for name, parent in VIA.items():  # the dependency that installs what is imported without being declared
        requires = {
            canonicalize_name(Requirement(r).name)
            for r in importlib.metadata.requires(parent) or ()
            if "extra ==" not in r
        }
        assert canonicalize_name(name) in requires, f"{parent} no longer requires {name}: declare it"


def test_a_gateway_host_installs_no_torch_and_no_build_tool():
    base = names("")
    assert not base & NOT_ON_A_GATEWAY, base & NOT_ON_A_GATEWAY
    assert {"torch", "diffusers"} <= names("model") and {"simpy", "matplotlib"} <= names("experiment")
    assert "grpcio-tools" in names("dev"), "make proto runs grpc_tools.protoc"
    assert "grpc_tools" not in imports_of(*(p.name for p in PACKAGE.iterdir() if p.is_dir())), (
        "grpcio-tools generates the stubs; nothing imports it at run time"
    )


def test_make_installs_every_extra_demo_and_test_use():
    makefile = (ROOT / "Makefile").read_text()
    extras = set(re.search(r"^EXTRAS :?= *(\S+)", makefile, re.M).group(1).split(","))
    assert {"model", "experiment", "test", "dev", "docs"} <= extras <= set(EXTRAS), extras
    assert "install -q -e '.[$(EXTRAS)]'" in makefile


@pytest.mark.slow
@pytest.mark.processes  # a fresh venv, pip, the CLI
@pytest.mark.timeout(600)
def test_a_plain_install_runs_the_gateway_without_torch(tmp_path):
    """`pip install <checkout>` (no extras) into a fresh venv with this machine's pip and package index, from the
    files a clean clone has (no stubs: the build generates them, setup.py): the base dependencies resolve, the
    gateway's code and the CLI run, and torch is not there."""
    source = tmp_path / "src"  # what git tracks that the build reads: pip builds in the tree, off the checkout
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in"):
        shutil.copy2(ROOT / name, source)
    shutil.copytree(ROOT / "protos", source / "protos")
    generated = ("__pycache__", "*.pyc", "*_pb2.py", "*_pb2_grpc.py", "*_pb2.pyi")
    shutil.copytree(PACKAGE, source / "h3serve", ignore=shutil.ignore_patterns(*generated))
    assert not list((source / "h3serve" / "v1").glob("*_pb2*")), "a clean clone holds no stubs"
    # The venv gets no pip of its own (ensurepip's install took 6 of the test's 51 CPU seconds): this machine's pip
    # (the suite's) installs into it and checks it, run by the venv's interpreter (`pip --python`), so it resolves,
    # builds and installs exactly as a pip inside the venv would.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python, env = (
        str(venv / "bin" / "python"),
        {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
    )
    pip = [sys.executable, "-m", "pip", "--python", python]
    install = subprocess.run(
        [*pip, "install", "-q", "--no-compile", str(source)],  # byte-compiles on import
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    consistent = subprocess.run([*pip, "check"], env=env, capture_output=True, text=True, timeout=60)
    assert consistent.returncode == 0, consistent.stdout

    code = f"""
import sys
import h3serve, h3serve.gateway.server, h3serve.gateway.http.app, h3serve.client
from h3serve.gateway.admission.request import RequestLimits, resolve
from h3serve.gateway.admission.text_rows import TextRows
from h3serve.model.rules import Geometry
from h3serve.v1 import gateway_pb2
import av, PIL.Image  # what the gateway's asset validation opens uploads with
rows = TextRows.load("", Geometry())  # the tiny preset's tokenizer, through transformers without torch
assert rows(resolve(gateway_pb2.GenerateRequest(prompt="a fox"), RequestLimits()), lambda asset_id: None) == 5
assert h3serve.__file__.startswith({str(venv)!r}), h3serve.__file__
print(sorted(m for m in sys.modules if m.split(".")[0] in {"torch", "torchvision", "diffusers"}))
"""
    out = subprocess.run([python, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
    cli = subprocess.run(
        [str(venv / "bin" / "h3serve"), "capacity", "--config", str(ROOT / "docs" / "deploy" / "tiny-cpu.toml")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0 and "packed rows" in cli.stdout, cli.stdout + cli.stderr
    for module in ("torch", "diffusers", "simpy", "matplotlib", "grpc_tools"):
        absent = subprocess.run(
            [python, "-c", f"import {module}"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
        )
        assert absent.returncode != 0 and "ModuleNotFoundError" in absent.stderr, (module, absent.stderr)
