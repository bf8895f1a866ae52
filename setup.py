"""The build generates the gRPC stubs (h3serve/v1/*_pb2*.py, *.pyi) from protos/h3serve/v1/*.proto, so that
`pip install .` (or `-e .`) from a clean clone gives an importable gateway, client and CLI with no `make proto`.

Generated at build time rather than committed: the stubs are derived from the protos, so every install holds the
stubs of the protos beside it, and branches that change a proto never conflict over generated code. grpcio-tools
is pinned in [build-system] requires, so every build emits the same stubs; the base dependencies' grpcio and
protobuf floors are what those stubs check at import. Everything else is in pyproject.toml.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTOS = ROOT / "protos"


def generate_stubs() -> None:
    """protoc (grpcio-tools) writes the stubs next to h3serve/v1/__init__.py, where both a wheel's build and an
    editable install find them."""
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTOS)) for p in (PROTOS / "h3serve" / "v1").glob("*.proto"))
    well_known = str(resources.files("grpc_tools") / "_proto")
    out = str(ROOT)
    args = ["protoc", f"-I{PROTOS}", f"-I{well_known}", f"--python_out={out}", f"--grpc_python_out={out}"]
    if protoc.main([*args, f"--pyi_out={out}", *protos]):
        raise SystemExit(f"protoc could not compile {PROTOS}/h3serve/v1 (its errors are above)")


class BuildWithStubs(build_py):
    def run(self) -> None:
        generate_stubs()
        super().run()


setup(cmdclass={"build_py": BuildWithStubs})
