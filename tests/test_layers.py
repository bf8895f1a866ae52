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


def _h3serve_imports(path: Path) -> set[str]:
    """The h3serve packages a module imports, at any depth of its code (function-level imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = (
            [alias.name for alias in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
            if isinstance(node, ast.ImportFrom)
            else []
        )
        found |= {name.split(".")[1] for name in names if name.startswith("h3serve.") and name.count(".") >= 1}
    return found


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
