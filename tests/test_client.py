"""The client package (h3serve/client/, docs/client.md): pure Python and shipped alone as a wheel; retries with
back-off against a real local gRPC server; job events exactly once across a gateway restart, in the client and in
`h3serve generate`; TLS and a bearer token; the walkthrough from the installed wheel."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time
import tomllib
import zipfile
from collections import defaultdict
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from deployments import write_config

from h3serve.cli.launcher import ServiceGroup
from h3serve.client import GatewayClient, GatewayUnreachable, RetryPolicy, default_address, describe_event
from h3serve.common.config import DeployConfig, load_deploy
from h3serve.common.free_ports import free_port
from h3serve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, retry_info

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parents[1]
S = gateway_pb2
TOKEN = "s3cret"
# What importing the client may load besides the standard library, what `import grpc` loads by itself, and the
# root packages "h3serve" and "google" (a namespace).
CLIENT_PACKAGES = (
    "grpc",
    "grpc_status",
    "google.protobuf",
    "google._upb",
    "google.rpc",
    "h3serve.client",
    "h3serve.v1",
)


def request(prompt: str, steps: int, seed: int = 1, **fields) -> gateway_pb2.GenerateRequest:
    return S.GenerateRequest(
        prompt=prompt,
        height=32,
        width=64,
        **fields,
        params=common_pb2.GenerationParams(num_inference_steps=steps, seed=seed),
    )


def quick(attempts: int) -> RetryPolicy:
    return RetryPolicy(attempts=attempts, initial_s=0.05, max_s=0.1)


# --- what the package is -------------------------------------------------------------------------------------------


def test_the_client_imports_only_grpc_its_rich_status_protobuf_the_stdlib_and_the_stubs(tmp_path):
    code = (
        "import sys, grpc\nbefore = set(sys.modules)\nimport h3serve.client\nprint(*sorted(set(sys.modules) - before))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path
    ).stdout.split()
    foreign = [
        name
        for name in loaded
        if name.split(".")[0] not in sys.stdlib_module_names
        and name not in ("h3serve", "google")
        and not name.startswith(tuple(f"{p}." for p in CLIENT_PACKAGES))
        and name not in CLIENT_PACKAGES
    ]
    assert not foreign, f"h3serve.client loads {foreign}"
    assert {"h3serve.client.gateway", "h3serve.v1.gateway_pb2_grpc"} <= set(loaded), "the check sees the client"


def test_the_default_gateway_is_h3serve_gateway_else_the_gateways_default_port(monkeypatch):
    monkeypatch.delenv("H3SERVE_GATEWAY", raising=False)
    assert default_address() == f"127.0.0.1:{DeployConfig().gateway.port}"
    monkeypatch.setenv("H3SERVE_GATEWAY", "gateway.example:6000")
    with GatewayClient() as client:
        assert default_address() == client.address == "gateway.example:6000"


def test_wait_ready_names_an_address_where_no_gateway_answers():
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with GatewayClient(address) as client, pytest.raises(GatewayUnreachable) as err:
        client.wait_ready(0.5)
    assert str(err.value) == f"no h3serve gateway answers at {address} within 0.5 s"
    assert time.monotonic() - started < 5


def test_describe_event_has_a_line_for_every_kind_of_event():
    for field in S.JobEvent.DESCRIPTOR.oneofs_by_name["kind"].fields:
        event = S.JobEvent(job_id="j")
        getattr(event, field.name).SetInParent()
        assert describe_event(event), field.name


def test_a_step_that_compiled_says_so():
    step = S.Denoising(step=1, total=4, step_seconds=30.0, elapsed_seconds=30.0, eta_seconds=3.0)
    assert "compiled" not in describe_event(S.JobEvent(denoising=step))
    step.compiled_graphs = 2
    assert describe_event(S.JobEvent(denoising=step)).endswith("(compiled 2 graphs: a shape not warmed)")


def test_the_retry_policy_backs_off_exponentially_up_to_its_bound():
    assert list(RetryPolicy(attempts=6, initial_s=0.5, max_s=3.0).delays()) == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert list(RetryPolicy(attempts=1).delays()) == []
    for wrong in (dict(attempts=0), dict(initial_s=2.0, max_s=1.0), dict(multiplier=0.5)):
        with pytest.raises(ValueError):
            RetryPolicy(**wrong)


# --- retries and credentials against a real local gRPC server -------------------------------------------------------


class QueueFull(gateway_pb2_grpc.GatewayServicer):
    """Submit answers RESOURCE_EXHAUSTED `full` times, as a gateway whose queue is full, then queues the job; every
    call's request and metadata are kept."""

    def __init__(self, full: int) -> None:
        self.full = full
        self.calls: list[tuple[gateway_pb2.GenerateRequest, dict[str, str]]] = []

    def Submit(self, request, context):
        self.calls.append((request, dict(context.invocation_metadata())))
        if len(self.calls) <= self.full:  # with the retry time the gateway's refusal carries (0 s: a quick test)
            message = f"{self.full} unfinished jobs, the bound is {self.full}"
            context.set_trailing_metadata(retry_info.details(grpc.StatusCode.RESOURCE_EXHAUSTED, message, 0))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        return S.Job(job_id="j-1", state=S.JOB_STATE_QUEUED, request_id=request.request_id)


@contextmanager
def local_gateway(servicer: QueueFull, credentials: grpc.ServerCredentials | None = None) -> Iterator[str]:
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
    address = "127.0.0.1:0"
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)


def test_submit_retries_a_full_queue_with_one_request_id_and_returns_the_job():
    servicer = QueueFull(full=2)
    sent = request("a queue that drains", steps=8)
    with local_gateway(servicer) as address, GatewayClient(address, retry=quick(3)) as client:
        started = time.monotonic()
        job = client.submit(sent)
        waited = time.monotonic() - started
    ids = {request.request_id for request, _ in servicer.calls}
    assert len(servicer.calls) == 3 and job.job_id == "j-1"
    assert len(ids) == 1 and job.request_id in ids and job.request_id, "every try is the same job"
    assert sent.request_id == "", "the caller's request is left unchanged"
    assert waited >= 0.05 + 0.1, "backed off between the tries"


def test_submit_gives_up_after_its_attempts_and_keeps_the_callers_request_id():
    servicer = QueueFull(full=5)
    with (
        local_gateway(servicer) as address,
        GatewayClient(address, retry=quick(3)) as client,
        pytest.raises(grpc.RpcError) as err,
    ):
        client.submit(request("never admitted", steps=8, request_id="mine"))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "the bound is 5" in err.value.details()
    assert [request.request_id for request, _ in servicer.calls] == ["mine"] * 3


def test_tls_and_the_bearer_token_reach_the_server(certificate):
    cert, key = certificate
    servicer = QueueFull(full=0)
    credentials = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
    with local_gateway(servicer, credentials) as address:
        with GatewayClient(address, root_pem=cert.read_bytes(), token=TOKEN) as client:
            assert client.submit(request("over TLS", steps=8)).job_id == "j-1"
        with GatewayClient(address, retry=quick(2)) as plaintext, pytest.raises(grpc.RpcError) as err:
            plaintext.submit(request("in the clear", steps=8))
    assert servicer.calls[0][1]["authorization"] == f"Bearer {TOKEN}"
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and len(servicer.calls) == 1


# --- against the real stack ----------------------------------------------------------------------------------------


def test_events_and_generate_follow_a_job_exactly_once_across_a_gateway_restart(stack, dit_hold, tmp_path):
    """A job is followed by `client.events()` and by `h3serve generate` (the same job: the same request_id) while
    the gateway is killed mid-denoise (the DiT holds the job at HOLD_STEP until then: a clean clone's run once saw
    the 30 steps end before the kill) and started again: the job runs again, and both see all of it, in order."""
    job_request = request("a lighthouse in a gale", steps=30, seed=7, request_id="restart-followed-1")
    # --connect-timeout: the gateway may already be down for its restart when this process first connects (its
    # start takes seconds on a loaded machine), and that wait is not what this test is about
    cli = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "h3serve.cli",
            "generate",
            "--gateway",
            stack.address("gateway"),
            "--connect-timeout",
            "120",
            "--prompt",
            job_request.prompt,
            "--height",
            "32",
            "--width",
            "64",
            "--steps",
            "30",
            "--seed",
            "7",
            "--request-id",
            job_request.request_id,
            "--out",
            str(tmp_path / "cli.mp4"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    held = threading.Event()

    def follow(client: GatewayClient, job_id: str) -> list[gateway_pb2.JobEvent]:
        seen = []
        for event in client.events(job_id):
            seen.append(event)
            if dit_hold.holds(event):
                held.set()
        return seen

    with GatewayClient(stack.address("gateway")) as client, ThreadPoolExecutor(1) as pool:
        with dit_hold.armed():
            job = client.submit(job_request)
            following = pool.submit(follow, client, job.job_id)
            assert held.wait(120), "the job did not reach the hold step"
            # From this thread: a service's parent-death signal follows the thread that started it.
            stack.group.restart("gateway", signal.SIGKILL)
        seen = following.result(timeout=300)
        stored = list(client.stub.Watch(S.WatchRequest(job_id=job.job_id)))
    out, err = cli.communicate(timeout=300)
    kinds = [event.WhichOneof("kind") for event in seen]
    assert seen == stored and [event.seq for event in seen] == list(range(1, len(seen) + 1))
    assert kinds.count("accepted") == 1 and kinds.count("retrying") == 1 and kinds[-1] == "done"
    assert cli.returncode == 0, err
    # a restart spends no attempt: the job killed mid-denoise is re-run 1 of 10 on its first attempt
    restarted = (
        "the gateway restarted while this job was in the dit stage; re-run 1 of 10 after a restart; attempt not counted"
    )
    assert seen[kinds.index("retrying")].retrying == S.Retrying(attempt=1, max_attempts=3, reason=restarted)
    assert f"accepted {job.job_id}" in err and f"retrying: attempt 1/3: {restarted}\n" in err and "done: " in err
    assert (tmp_path / "cli.mp4").stat().st_size == seen[-1].done.video.bytes


def test_jobs_walks_every_page_in_either_order_and_the_bin(stack):
    with GatewayClient(stack.address("gateway")) as client:
        ids = [client.generate(request(f"a page of jobs {i}", steps=2, seed=i)).job_id for i in range(3)]
        everything = [job.job_id for job in client.stub.ListJobs(S.ListJobsRequest(page_size=1000)).jobs]
        assert [job.job_id for job in client.jobs(page_size=2)] == everything
        assert [job.job_id for job in client.jobs(page_size=2, oldest_first=True)] == everything[::-1]
        succeeded = [job.job_id for job in client.jobs(states=[S.JOB_STATE_SUCCEEDED], page_size=1)]
        assert succeeded[:3] == ids[::-1], "newest first"

        binned = client.delete(ids[1])
        assert binned.deleted > 0 and binned.state == S.JOB_STATE_SUCCEEDED
        after_first = client.jobs(oldest_first=True, after_job_id=ids[0], page_size=1)  # then by page token
        assert [job.job_id for job in after_first] == [ids[2]]
        assert ids[1] in [job.job_id for job in client.jobs(deleted=True, page_size=1)]
        assert client.restore(ids[1]).deleted == 0
        assert [job.job_id for job in client.jobs(oldest_first=True, after_job_id=ids[0], page_size=1)] == ids[1:]


def test_events_of_an_unknown_job_fail_at_once(stack):
    with GatewayClient(stack.address("gateway")) as client:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            next(client.events("no-such-job"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and time.monotonic() - started < 5


# --- the wheel, and the walkthrough from it against TLS and a token ----------------------------------------------


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """`make client`'s build, into a temporary dist directory."""
    dist = tmp_path_factory.mktemp("dist")
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "client_wheel.py"), "--dist", str(dist)], capture_output=True, text=True
    )
    if out.returncode and importlib.util.find_spec("setuptools") is None:
        pytest.skip(f"no setuptools here and pip could not fetch one to build with: {out.stdout[-500:]}")
    assert out.returncode == 0, out.stdout + out.stderr
    return Path(out.stdout.strip())


def wheel_files(wheel: Path) -> tuple[list[str], str]:
    """The wheel's file names and its METADATA."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert wheel.name == f"h3serve_client-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist(), archive.read(f"h3serve_client-{version}.dist-info/METADATA").decode()


def canonical(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def declared(metadata: str) -> dict[str, set[str]]:
    """The distributions each extra requires ("": the requirements of a plain install)."""
    out = defaultdict(set)
    for name, marker in re.findall(r"^Requires-Dist: ([\w.-]+)[^;\n]*(?:;(.*))?$", metadata, re.M):
        extra = re.search(r'extra == "([\w.-]+)"', marker)
        out[extra.group(1) if extra else ""].add(canonical(name))
    return out


def third_party_imports(sources: Iterable[str]) -> set[str]:
    """Every module the sources import (at the top or inside functions) outside the standard library and h3serve."""
    modules = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                modules.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules.add(node.module)
    return {m for m in modules if m.split(".")[0] not in (*sys.stdlib_module_names, "h3serve")}


def distribution_of(module: str) -> str:
    """The installed distribution whose files hold `module` (the top-level "google" is shared by several)."""
    spec = importlib.util.find_spec(module)
    # a namespace package (google.rpc) has no file of its own: the distribution holding a file in its directory
    where = [spec.origin] if spec.origin else spec.submodule_search_locations
    places = [Path(p).resolve() for p in where]
    for name in importlib.metadata.packages_distributions()[module.split(".")[0]]:
        distribution = importlib.metadata.distribution(name)
        for file in distribution.files or ():
            path = Path(distribution.locate_file(file)).resolve()
            if path in places or path.parent in places:
                return canonical(name)
    raise AssertionError(f"no installed distribution holds {module} ({places})")


def walkthrough_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "client.md").read_text(), re.S)


def test_the_wheel_holds_the_stubs_and_the_client_and_requires_grpcio_protobuf_and_rich_status_only(wheel):
    names, metadata = wheel_files(wheel)
    expected = {
        "h3serve/__init__.py",
        *(f"h3serve/client/{path.name}" for path in (ROOT / "h3serve" / "client").glob("*.py")),
        *(f"h3serve/v1/{path.name}" for path in (ROOT / "h3serve" / "v1").glob("*.py*")),
    }
    assert {name for name in names if ".dist-info/" not in name} == expected
    assert declared(metadata)[""] == {"grpcio", "protobuf", "grpcio-status", "googleapis-common-protos"}, metadata


def test_the_wheel_declares_what_the_client_and_the_walkthrough_import(wheel):
    """Parsed from the sources the wheel ships and from docs/client.md's code: an import added without its
    requirement fails here. The walkthrough's own imports may come from the `walkthrough` extra its install line
    names."""
    names, metadata = wheel_files(wheel)
    requires = declared(metadata)
    shipped = [(ROOT / name).read_text() for name in names if name.endswith(".py")]
    client = {module: distribution_of(module) for module in third_party_imports(shipped)}
    assert {"grpc", "google.protobuf"} <= set(client), "the check sees the client's imports"
    assert {m: d for m, d in client.items() if d not in requires[""]} == {}, metadata
    walkthrough = {module: distribution_of(module) for module in third_party_imports(walkthrough_blocks())}
    assert {m: d for m, d in walkthrough.items() if d not in requires[""] | requires["walkthrough"]} == {}, metadata
    assert '.whl[walkthrough]"' in (ROOT / "docs" / "client.md").read_text(), "the install line names the extra"


@pytest.mark.slow
def test_the_wheel_installs_into_a_fresh_venv_with_what_the_walkthrough_imports(wheel, tmp_path):
    """A plain venv (no system site-packages) and pip, as docs/client.md's install line runs it."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-compile", f"{wheel}[walkthrough]"], check=True, timeout=300
    )
    modules = sorted({m for m in third_party_imports(walkthrough_blocks())} | {"h3serve.client", "h3serve.v1"})
    code = f"import {', '.join(modules)}\nimport h3serve.client\nprint(h3serve.client.__file__)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([python, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(str(venv)), out.stdout


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The wheel installed on its own into a directory (`pip install --target`), first on PYTHONPATH below."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        check=True,
    )
    return target


@pytest.fixture(scope="module")
def tls_gateway(stack, certificate, tmp_path_factory) -> Iterator[str]:
    """A second gateway on the stack's model services, serving TLS and requiring TOKEN."""
    cert, key = certificate
    root = tmp_path_factory.mktemp("tls-gateway")
    ports = {**stack.ports, "gateway": free_port()}
    config = write_config(
        root / "tls.toml",
        str(stack.model_dir),
        root / "gateway",
        ports,
        auth_token=TOKEN,
        tls_cert=str(cert),
        tls_key=str(key),
    )
    with ServiceGroup(load_deploy(config), str(config), log_dir=str(root), names=("gateway",)):
        yield f"127.0.0.1:{ports['gateway']}"


def test_the_walkthrough_runs_from_the_installed_wheel_against_tls_and_a_token(
    installed, tls_gateway, certificate, tmp_path
):
    blocks = walkthrough_blocks()
    from_wheel = f"import h3serve.client\nassert h3serve.client.__file__.startswith({str(installed)!r})\n"
    env = {
        **os.environ,
        "PYTHONPATH": str(installed),
        "H3SERVE_GATEWAY": tls_gateway,
        "H3SERVE_CA": str(certificate[0]),
        "H3SERVE_TOKEN": TOKEN,
    }
    out = subprocess.run(
        [sys.executable, "-c", from_wheel + "\n".join(blocks)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "\nJOB_STATE_CANCELLED\ncancelled: " in out.stdout and "refused: INVALID_ARGUMENT: " in out.stdout
    for name in ("kite.mp4", "dawn.mp4"):
        assert (tmp_path / name).stat().st_size > 0, name


def test_a_wrong_token_is_refused_at_once(tls_gateway, certificate):
    with (
        GatewayClient(tls_gateway, root_pem=certificate[0].read_bytes(), token="wrong") as client,
        pytest.raises(grpc.RpcError) as err,
    ):
        client.info()
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
