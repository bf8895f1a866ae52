"""Build the h3serve-client wheel (`make client`): h3serve/__init__.py, the generated stubs (h3serve/v1/) and the
client (h3serve/client/), requiring grpcio, protobuf and grpc's rich status only; its `walkthrough` extra adds
Pillow, which docs/client.md's code uses to draw a keyframe (the client itself never does).

    python tools/client_wheel.py [--dist DIR]      prints the wheel's path

The files are staged in a temporary directory with a pyproject of their own. The version is h3serve's; the
dependency bounds are the ones the generated stubs check when they are imported, Pillow's the server package's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"h3serve": ["__init__.py"], "h3serve.v1": ["*.py", "*.pyi"], "h3serve.client": ["*.py"]}
RICH_STATUS = ["grpcio-status", "googleapis-common-protos"]  # google.rpc.RetryInfo (h3serve/v1/retry_info.py)
WALKTHROUGH = ["pillow"]  # what docs/client.md imports beyond the client: `pip install "<wheel>[walkthrough]"`


def requirements() -> list[str]:
    """grpcio at least the stubs' GRPC_GENERATED_VERSION; protobuf of the gencode's major, at least its version."""
    grpc_stub = (ROOT / "h3serve/v1/gateway_pb2_grpc.py").read_text()
    grpc_version = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_stub).group(1)
    message_stub = (ROOT / "h3serve/v1/gateway_pb2.py").read_text()
    major, minor, patch = re.search(r"Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", message_stub).groups()
    return [f"grpcio>={grpc_version}", f"protobuf>={major}.{minor}.{patch},<{int(major) + 1}"]


def server_requirement(name: str, project: dict) -> str:
    """The server package's requirement on `name`, bounds included."""
    return next(r for r in project["dependencies"] if re.match(r"[\w.-]+", r).group().lower() == name)


def pyproject() -> str:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    walkthrough = [server_requirement(name, project) for name in WALKTHROUGH]
    return f"""[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "h3serve-client"
version = {json.dumps(project["version"])}
description = "Python client of h3serve's public gRPC API (h3serve.v1.Gateway)"
requires-python = {json.dumps(project["requires-python"])}
dependencies = {json.dumps(requirements() + [server_requirement(name, project) for name in RICH_STATUS])}
optional-dependencies = {{ walkthrough = {json.dumps(walkthrough)} }}

[tool.setuptools]
packages = {json.dumps(list(PACKAGES))}
package-data = {{ "h3serve.v1" = ["*.pyi"] }}
"""


def stage(target: Path) -> None:
    for package, patterns in PACKAGES.items():
        source = ROOT / package.replace(".", "/")
        (target / source.relative_to(ROOT)).mkdir(parents=True)
        for pattern in patterns:
            for path in source.glob(pattern):
                shutil.copy2(path, target / path.relative_to(ROOT))
    (target / "pyproject.toml").write_text(pyproject())


def build(dist: Path) -> Path:
    """The wheel in `dist`; setuptools from the running environment when it has one (no network)."""
    dist.mkdir(parents=True, exist_ok=True)
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    with tempfile.TemporaryDirectory(prefix="h3serve-client-") as staging:
        stage(Path(staging))
        out = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", str(dist), staging],
            capture_output=True,
            text=True,
        )
    if out.returncode:
        raise SystemExit(f"pip wheel failed:\n{out.stdout}{out.stderr}")
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    return dist / f"h3serve_client-{version}-py3-none-any.whl"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dist", type=Path, default=ROOT / "dist")
    print(build(parser.parse_args().dist))
