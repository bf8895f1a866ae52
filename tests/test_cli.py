"""The `h3serve` command as a user runs it: `up` with Ctrl-C, `generate` against TLS and a token, `reference`
byte for byte, `demo`, and the Python walkthrough of docs/client.md; real processes, the tiny model."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from conftest import free_port, write_config

from h3serve.cli.launcher import ServiceGroup, children, is_serving
from h3serve.common.config import load_deploy

CLI = [sys.executable, "-m", "h3serve.cli"]
ROOT = Path(__file__).resolve().parents[1]
README_REQUEST = ["--height", "32", "--width", "64", "--steps", "8", "--seed", "7"]  # the README's comparison
QUICK = ["--height", "32", "--width", "64", "--steps", "2"]


def descendants(pid: int) -> list[int]:
    return [p for child in children(pid) for p in (child, *descendants(child))]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@dataclass
class Up:
    process: subprocess.Popen
    config: Path
    log_dir: Path
    output: Path


@pytest.fixture(scope="module")
def up(tmp_path_factory, tiny_model_dir):
    """`h3serve up` as from a terminal (its own process group, the foreground job), with threads = 1 model services
    as in docs/deploy/tiny-cpu.toml and a log directory that does not exist yet. The last test stops it."""
    root = tmp_path_factory.mktemp("up")
    ports = {name: free_port() for name in ("encoder", "dit", "vae", "gateway")}
    config = write_config(root / "deploy.toml", str(tiny_model_dir), root / "gateway", ports,
                          service_keys={"threads": 1})
    log_dir, output = root / "logs" / "up", root / "up.out"
    with open(output, "wb") as out:
        process = subprocess.Popen([*CLI, "up", "--config", str(config), "--log-dir", str(log_dir)], stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    started = []
    try:
        deadline = time.monotonic() + 240
        while not is_serving(f"127.0.0.1:{ports['gateway']}"):
            assert process.poll() is None, output.read_text()
            assert time.monotonic() < deadline, "not healthy in time"
            time.sleep(0.5)
        started = descendants(process.pid)
        yield Up(process, config, log_dir, output)
    finally:
        started = started or descendants(process.pid)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
        for pid in started:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_up_creates_a_missing_log_dir(up):
    assert sorted(path.name for path in up.log_dir.iterdir()) == ["dit.log", "encoder.log", "gateway.log", "vae.log"]


@pytest.mark.fidelity
def test_served_raw_is_byte_identical_to_reference_with_the_same_config(up, tmp_path):
    """The README's comparison: threads = 1 services against `reference --config` (not torch's default threads)."""
    config = ["--config", str(up.config), *README_REQUEST]
    subprocess.run([*CLI, "generate", *config, "--out", str(tmp_path), "--raw", str(tmp_path / "served.npz")],
                   check=True, capture_output=True)
    subprocess.run([*CLI, "reference", *config, "--raw", str(tmp_path / "ref.npz")], check=True, capture_output=True)
    served, reference = np.load(tmp_path / "served.npz"), np.load(tmp_path / "ref.npz")
    assert served["frames"].shape == (124, 32, 64, 3)
    assert {key for key in served if not np.array_equal(served[key], reference[key])} == set()


def test_ctrl_c_stops_up_with_clean_logs_and_no_process_left(up):
    """Runs last in this module: it stops the `up` fixture."""
    processes = descendants(up.process.pid)
    assert len(processes) >= 5, "encoder, the DiT's launcher and its rank, vae, gateway"
    os.killpg(up.process.pid, signal.SIGINT)  # Ctrl-C: the terminal signals its foreground process group
    assert up.process.wait(60) == 0, up.output.read_text()
    deadline = time.monotonic() + 10  # orphaned zombies are reaped by init
    while any(alive(pid) for pid in processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in processes if alive(pid)] == []
    assert up.output.read_text().rstrip().endswith("stopping")
    for log in sorted(up.log_dir.glob("*.log")):
        text = log.read_text()
        assert "ERROR" not in text and "Traceback" not in text, f"{log.name}:\n{text}"


def test_demo_keeps_its_jobs_in_a_fresh_data_dir(tmp_path, tiny_model_dir):
    ports = {name: free_port() for name in ("encoder", "dit", "vae", "gateway")}
    up_data = tmp_path / "up-data"
    config = write_config(tmp_path / "deploy.toml", str(tiny_model_dir), up_data, ports)
    out = subprocess.run([*CLI, "demo", "--config", str(config), *QUICK, "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr
    jobs = Path(re.search(r"jobs in (\S+): a fresh data directory", out.stdout).group(1))
    try:
        assert not up_data.exists(), "the demo does not touch the deployment's data_dir"
        assert [path.name for path in jobs.rglob("h3-*.mp4")] == [path.name for path in (tmp_path / "out").iterdir()]
    finally:
        shutil.rmtree(jobs.parent)


def test_generate_reaches_a_tls_gateway_with_a_token(stack, tmp_path, certificate):
    cert, key = certificate
    ports = {**stack.ports, "gateway": free_port()}
    config = write_config(tmp_path / "tls.toml", str(stack.model_dir), tmp_path / "gateway", ports,
                          auth_token="s3cret", tls_cert=str(cert), tls_key=str(key))
    env = {k: v for k, v in os.environ.items() if k != "H3SERVE_TOKEN"}
    with ServiceGroup(load_deploy(config), str(config), log_dir=str(tmp_path), names=("gateway",)):
        generate = [*CLI, "generate", "--gateway", f"127.0.0.1:{ports['gateway']}", "--ca", str(cert), *QUICK]
        flag = subprocess.run([*generate, "--token", "s3cret", "--out", str(tmp_path / "flag.mp4")], env=env,
                              capture_output=True, text=True)
        assert flag.returncode == 0, flag.stderr
        from_env = subprocess.run([*generate, "--out", str(tmp_path / "env.mp4")], capture_output=True, text=True,
                                  env={**env, "H3SERVE_TOKEN": "s3cret"})
        assert from_env.returncode == 0, from_env.stderr
        refused = subprocess.run([*generate, "--out", str(tmp_path / "no.mp4")], env=env, capture_output=True,
                                 text=True)
    assert (tmp_path / "flag.mp4").stat().st_size > 0 and (tmp_path / "env.mp4").stat().st_size > 0
    assert refused.returncode != 0 and not (tmp_path / "no.mp4").exists()
    assert refused.stderr.startswith("h3serve generate: UNAUTHENTICATED: "), refused.stderr


def test_the_client_walkthrough_runs_as_written(stack, tmp_path, monkeypatch):
    """Every python block of docs/client.md, in order, against the stack's gateway."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "client.md").read_text(), re.S)
    assert len(blocks) >= 3
    monkeypatch.setenv("H3SERVE_GATEWAY", stack.address("gateway"))
    monkeypatch.delenv("H3SERVE_TOKEN", raising=False)
    monkeypatch.delenv("H3SERVE_CA", raising=False)
    monkeypatch.chdir(tmp_path)
    exec(compile("\n".join(blocks), str(ROOT / "docs" / "client.md"), "exec"), {"__name__": "client_md"})
    for name in ("kite.mp4", "dawn.mp4"):
        assert (tmp_path / name).stat().st_size > 0, name
