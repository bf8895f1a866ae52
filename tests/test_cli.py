"""The `h3serve` command as a user runs it: `up` with Ctrl-C, `generate` against TLS and a token, `reference`
byte for byte, `demo`, and the Python walkthrough of docs/client.md; real processes, the tiny model."""

from __future__ import annotations

import io
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
from deployments import write_config
from forked import run_forked
from up_process import own_environment

from h3serve.cli.generate import Progress
from h3serve.cli.launcher import ServiceGroup, children, is_serving
from h3serve.cli.main import main as cli_main
from h3serve.client import describe_event
from h3serve.common.config import MAX_PROMPT_CHARS, load_deploy
from h3serve.common.free_ports import free_port
from h3serve.model import rules
from h3serve.v1 import gateway_pb2

pytestmark = pytest.mark.processes

CLI = [sys.executable, "-m", "h3serve.cli"]
ROOT = Path(__file__).resolve().parents[1]
README_REQUEST = ["--height", "32", "--width", "64", "--steps", "8", "--seed", "7"]  # docs/cli.md's comparison
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
    config = write_config(
        root / "deploy.toml", str(tiny_model_dir), root / "gateway", ports, service_keys={"threads": 1}
    )
    log_dir, output = root / "logs" / "up", root / "up.out"
    with open(output, "wb") as out:
        process = subprocess.Popen(
            [*CLI, "up", "--config", str(config), "--log-dir", str(log_dir)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=own_environment(),  # its own fork server: every process it starts is its descendant
        )
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
def test_served_raw_is_byte_identical_to_reference_with_the_same_config(up, fork_server, tmp_path):
    """docs/cli.md's comparison: threads = 1 services against `reference --config` (not torch's default threads)."""
    config = ["--config", str(up.config), *README_REQUEST]
    subprocess.run(
        [*CLI, "generate", *config, "--out", str(tmp_path), "--raw", str(tmp_path / "served.npz")],
        check=True,
        capture_output=True,
    )
    run_forked(fork_server, [*CLI, "reference", *config, "--raw", str(tmp_path / "ref.npz")])  # its imports done
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
    out = subprocess.run(
        [*CLI, "demo", "--config", str(config), *QUICK, "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=280,
    )
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
    config = write_config(
        tmp_path / "tls.toml",
        str(stack.model_dir),
        tmp_path / "gateway",
        ports,
        auth_token="s3cret",
        tls_cert=str(cert),
        tls_key=str(key),
    )
    env = {k: v for k, v in os.environ.items() if k != "H3SERVE_TOKEN"}
    with ServiceGroup(load_deploy(config), str(config), log_dir=str(tmp_path), names=("gateway",)):
        generate = [*CLI, "generate", "--gateway", f"127.0.0.1:{ports['gateway']}", "--ca", str(cert), *QUICK]
        flag = subprocess.run(
            [*generate, "--token", "s3cret", "--out", str(tmp_path / "flag.mp4")],
            env=env,
            capture_output=True,
            text=True,
        )
        assert flag.returncode == 0, flag.stderr
        assert "\x1b" not in flag.stderr and "\ndone: " in flag.stderr, "a pipe gets plain progress lines"
        from_env = subprocess.run(
            [*generate, "--out", str(tmp_path / "env.mp4")],
            capture_output=True,
            text=True,
            env={**env, "H3SERVE_TOKEN": "s3cret"},
        )
        assert from_env.returncode == 0, from_env.stderr
        refused = subprocess.run(
            [*generate, "--out", str(tmp_path / "no.mp4")], env=env, capture_output=True, text=True
        )
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


# --- what a user meets first: the address, the help, the progress to a file, the capacity ---------------------


def test_generate_takes_h3serve_gateway_and_names_a_gateway_that_does_not_answer(tmp_path):
    """Real unused loopback ports: a one-line refusal after --connect-timeout, not the retries' silence."""
    from_env, from_flag = (f"127.0.0.1:{free_port()}" for _ in range(2))
    for address, flags in ((from_env, []), (from_flag, ["--gateway", from_flag])):
        started = time.monotonic()
        out = subprocess.run(
            [*CLI, "generate", *QUICK, "--connect-timeout", "1", *flags],
            cwd=tmp_path,
            env={**os.environ, "H3SERVE_GATEWAY": from_env},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert (out.returncode, out.stderr) == (
            1,
            f"h3serve generate: no h3serve gateway answers at {address} within 1 s (H3SERVE_GATEWAY / --gateway)\n",
        )
        assert time.monotonic() - started < 20, "the timeout, not the retry policy's ~24 s"


def generate_help(monkeypatch, capsys) -> str:
    monkeypatch.setenv("COLUMNS", "1000")  # one line per option: the checks below read whole phrases
    with pytest.raises(SystemExit):
        cli_main(["generate", "--help"])
    return capsys.readouterr().out


def test_generate_help_states_the_canvas_and_frame_rules_of_the_model(monkeypatch, capsys):
    text = generate_help(monkeypatch, capsys)
    frames = f"{rules.FRAMES_PER_CHUNK}n+{rules.LATENTS_PER_CHUNK}"
    assert f"multiples of {rules.CANVAS_MULTIPLE}, width/height within 1:{rules.MAX_ASPECT}" in text
    assert f"at 24 fps: {frames} from {rules.VALID_NUM_FRAMES[0]} to {rules.VALID_NUM_FRAMES[-1]}" in text
    assert f"{rules.MIN_SECONDS} to {rules.MAX_SECONDS_EXACT:g} s: seconds x {rules.FPS} rounded" in text
    assert f"{rules.MIN_SECONDS} s: {rules.frames_for_seconds(rules.MIN_SECONDS)}" in text
    monkeypatch.setattr(rules, "CANVAS_MULTIPLE", 48)  # read from the rules, not restated
    monkeypatch.setattr(rules, "VALID_NUM_FRAMES", (22, 39))
    text = generate_help(monkeypatch, capsys)
    assert "multiples of 48," in text and f"{frames} from 22 to 39 (22, 39)" in text


def job_events() -> list[gateway_pb2.JobEvent]:
    steps = [gateway_pb2.JobEvent(denoising=gateway_pb2.Denoising(step=step, total=3)) for step in (1, 2, 3)]
    done = gateway_pb2.JobEvent(done=gateway_pb2.Done(video=gateway_pb2.Artifact(file_name="h3-j.mp4")))
    return [gateway_pb2.JobEvent(job_id="j", accepted=gateway_pb2.Accepted()), *steps, done]


def test_progress_to_a_file_is_one_plain_line_per_event(tmp_path):
    with open(tmp_path / "progress.log", "w") as stream:  # what `2> file` or `| tee` gives the CLI
        progress = Progress(stream)
        for event in job_events():
            progress(event)
        progress.end()
    text = (tmp_path / "progress.log").read_text()
    assert text.splitlines() == [describe_event(event) for event in job_events()]
    assert "\x1b" not in text and "\r" not in text


def test_progress_on_a_terminal_redraws_one_line():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    progress = Progress(stream)
    for event in job_events():
        progress(event)
    progress.end()
    assert stream.getvalue() == "".join(f"\r\x1b[K{describe_event(e)}" for e in job_events()) + "\n"


def test_capacity_states_the_max_rows_bound_on_single_32gb():
    path = ROOT / "docs" / "deploy" / "single-32gb.toml"
    gateway = load_deploy(path).gateway
    out = subprocess.run([*CLI, "capacity", "--config", str(path)], capture_output=True, text=True, check=True).stdout
    assert "every valid request is admitted" not in out
    # the file's own note: "max_rows = 42,000 admits 768x1344 x 124 frames"
    assert (
        f"every request: at most {gateway.max_rows:,} packed rows ([gateway] max_rows); at the default canvas "
        f"768x1344 (height x width): at most 124 frames (text 256 rows, no conditioning)"
    ) in out, out


def test_capacity_bounds_a_table_entry_by_max_rows(tmp_path):
    config = tmp_path / "deploy.toml"
    config.write_text('[gateway]\nmax_rows = 30000\n[gateway.capacity.t2va]\n"768x1344" = 38000\n')
    out = subprocess.run(
        [*CLI, "capacity", "--config", str(config)], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[1].split() == ["t2va", "768x1344", "30,000", "none", "fit"], "what admission lets through"
    assert out[2].startswith("every request: at most 30,000 packed rows ([gateway] max_rows)"), out


def test_generate_refuses_a_9_mb_prompt_file_before_sending_naming_the_limit(tmp_path):
    """Read from --prompt-file, the prompt never travels through exec's arguments (no E2BIG); checked before any
    connection (nothing listens at --gateway), it is refused naming the field and the limit."""
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("a" * (9 << 20))
    nobody = f"127.0.0.1:{free_port()}"
    done = subprocess.run(
        [*CLI, "generate", "--prompt-file", str(prompt), "--gateway", nobody, "--connect-timeout", "1"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1
    assert done.stderr.strip() == (
        f"h3serve generate: not sent: prompt: at most {MAX_PROMPT_CHARS} characters, got {9 << 20} "
        "(the shipped limits; --config names a deployment's)"
    )


@pytest.mark.parametrize(
    "flags,refusal",
    [
        (["--steps", "1"], f"num_inference_steps: must be between {rules.MIN_STEPS} and 12 "),
        (["--flow-shift", "0"], "flow_shift: must be a number with 0 < shift <= 100, got 0.0"),
        (["--height", "64"], "width: required when height is set"),
        (["--num-frames", "125"], "num_frames: must be 17n+5 between 124 and 345"),
        (["--prompt", "a fox on a long walk"], "prompt: at most 10 characters, got 20"),
    ],
)
def test_generate_checks_the_deployments_limits_before_sending(tmp_path, flags, refusal):
    config = tmp_path / "deploy.toml"
    config.write_text("[dit]\nmax_steps = 12\n\n[gateway]\nmax_steps = 12\ndefault_steps = 8\nmax_prompt_chars = 10\n")
    prompt = [] if "--prompt" in flags else ["--prompt", "a fox"]
    nobody = f"127.0.0.1:{free_port()}"
    with pytest.raises(SystemExit) as refused:
        cli_main(["generate", "--config", str(config), "--gateway", nobody, *prompt, *flags])
    assert str(refused.value.code).startswith(f"h3serve generate: not sent: {refusal}"), refused.value.code
    assert str(refused.value.code).endswith(f"(the limits of {config})")
