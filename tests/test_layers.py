"""The house's rooms: which package may import which, and a gateway that never loads torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import h3serve

ROOT = Path(h3serve.__file__).parent
# What each package may import of h3serve (itself always). Imports run down this list, never up.
ALLOWED = {
    "v1": set(),
    "model": {"v1"},
    "common": {"v1", "model"},
    "client": {"v1"},
    "experiment": {"v1", "model", "common", "client"},
    "gateway": {"v1", "model", "common"},
    "runtime": {"v1", "model", "common"},
    "services": {"v1", "model", "common", "runtime"},
    "cli": {"v1", "model", "common", "runtime", "services", "gateway", "client", "experiment"},
}
TORCH = ("torch", "torchvision", "torchaudio", "diffusers")


def _imported(path: Path) -> set[str]:
    """Every module name a module imports, at any depth of its code (function-level imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.add(node.module or "")
    return found


def _h3serve_imports(path: Path) -> set[str]:
    """The h3serve packages a module imports."""
    return {name.split(".")[1] for name in _imported(path) if name.startswith("h3serve.") and name.count(".") >= 1}


def test_every_package_imports_only_the_layers_below_it():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        package = path.relative_to(ROOT).parts[0].removesuffix(".py")
        if package in ("__init__", "v1"):
            continue
        for imported in _h3serve_imports(path) - ALLOWED[package] - {package}:
            wrong.append(f"{path.relative_to(ROOT.parent)} imports h3serve.{imported}")
    assert not wrong, "\n".join(wrong)
    assert set(ALLOWED) == {
        p.name.removesuffix(".py")
        for p in ROOT.iterdir()
        if p.name != "__init__.py" and not p.name.startswith("__pycache__")
    }, "a new package needs its place in ALLOWED"


def test_the_benches_import_nothing_of_the_tests():
    """The tests use the benches (what both need, such as request media or a PostgreSQL server, lives in bench/),
    never the other way round: a bench is a tool of its own, and a helper imported as `tests.x` by a bench and as `x`
    by the tests was two modules in one process."""
    tests = Path(__file__).parent
    helpers = {path.stem for path in tests.glob("*.py")} | {"tests"}
    wrong = [
        f"{path.relative_to(tests.parent)} imports {name}"
        for path in sorted((tests.parent / "bench").glob("*.py"))
        for name in sorted(_imported(path))
        if name.split(".")[0] in helpers
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.processes  # a fresh interpreter
def test_the_gateway_loads_without_torch_in_a_fresh_interpreter():
    """The gateway's server and everything it does at start and at submit: no torch, no diffusers."""
    code = f"""
import sys
from h3serve.gateway import server
from h3serve.gateway.admission.request import RequestLimits, resolve
from h3serve.gateway.admission.text_rows import TextRows
from h3serve.model.rules import Geometry
from h3serve.v1 import gateway_pb2
rows = TextRows.load("", Geometry())
resolved = resolve(gateway_pb2.GenerateRequest(prompt="a fox"), RequestLimits())
assert rows(resolved, lambda asset_id: None) == 5
print(sorted(m for m in sys.modules if m.split(".")[0] in {TORCH!r}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_running_gateway_process_has_no_torch_library_mapped(stack):
    gateway = next(item.process for item in stack.group.running if item.name == "gateway")
    maps = Path(f"/proc/{gateway.pid}/maps").read_text()
    assert "libtorch" not in maps and "/torch/" not in maps
    encoder = next(item.process for item in stack.group.running if item.name == "encoder")
    assert "libtorch" in Path(f"/proc/{encoder.pid}/maps").read_text(), "the check itself can see torch"
