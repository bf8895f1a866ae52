"""The plan bounds admission: the largest request each workflow can hold on a deployment's cards (common/ceilings.py),
printed by `h3serve plan` and refused over at submit by a real gateway, on a small emulated card."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from h3serve.cli import capacity
from h3serve.cli.launcher import ServiceGroup, is_answering
from h3serve.common.ceilings import Ceilings, require_holding
from h3serve.common.config import ConfigError, load_deploy
from h3serve.common.free_ports import free_port
from h3serve.model import rules
from h3serve.v1 import error_info, gateway_pb2, gateway_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
PROFILES = sorted((ROOT / "docs" / "deploy").glob("*.toml"))
PROMPT, PROMPT_ROWS = "a fox", 5  # the tiny tokenizer's rows for it (tests/test_layers.py)
# The released model's sizes on an emulated card: the DiT's fp8 blocks streamed, the VAE resident, the encoder on the
# CPU; the tiny model's tokenizer counts the prompt's rows. 20 GiB holds no 768x1344 clip and a short 480x832 one.
SMALL_CARD = """
[model]
dir = ""

[encoder]
port = {encoder}

[dit]
port = {dit}
device = "cuda"
dtype = "bfloat16"
fp8 = true
offload = "group"
workflows = ["t2va"]

[vae]
port = {vae}
device = "cuda"
dtype = "bfloat16"

[gateway]
port = {gateway}
http_port = {http}
data_dir = "{data_dir}"

[supervisor]
gpu_memory_gib = {gpu_gib}
"""


def small_card(tmp_path: Path, gpu_gib: float) -> Path:
    ports = {name: free_port() for name in ("encoder", "dit", "vae", "gateway", "http")}
    path = tmp_path / f"card-{gpu_gib:g}.toml"
    path.write_text(SMALL_CARD.format(**ports, data_dir=tmp_path / "gateway", gpu_gib=gpu_gib))
    return path


def held_frames(ceilings: Ceilings, height: int, width: int, text_rows: int) -> int | None:
    """The longest clip at a canvas whose rows are within the plan's ceiling, counted here from the model's rules."""
    held = [
        f
        for f in rules.VALID_NUM_FRAMES
        if (most := ceilings.rows(height, width, f)) is not None
        and text_rows + rules.generated_rows(height, width, f).total <= most
    ]
    return held[-1] if held else None


def submit(address: str, height: int, width: int, frames: int) -> gateway_pb2.Job:
    with grpc.insecure_channel(address) as channel:
        request = gateway_pb2.GenerateRequest(prompt=PROMPT, height=height, width=width, num_frames=frames)
        return gateway_pb2_grpc.GatewayStub(channel).Submit(request, timeout=30)


@pytest.mark.processes
def create(http_port: int, size: str, seconds: float) -> tuple[int, dict]:
    """POST /v1/videos on the HTTP door: its status and JSON body."""
    body = json.dumps({"prompt": PROMPT, "size": size, "seconds": seconds}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{http_port}/v1/videos", data=body, headers={"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def test_a_gateway_refuses_a_request_over_the_plans_ceiling_with_the_ceiling(tmp_path):
    path = small_card(tmp_path, 20.0)
    ceilings = Ceilings(load_deploy(path))
    longest = held_frames(ceilings, 480, 832, PROMPT_ROWS)
    assert longest is not None and rules.VALID_NUM_FRAMES[0] < longest < rules.VALID_NUM_FRAMES[-1]
    assert held_frames(ceilings, 768, 1344, PROMPT_ROWS) is None, "the card holds no 768x1344 clip"
    address = f"127.0.0.1:{load_deploy(path).gateway.port}"
    group = ServiceGroup(load_deploy(path), str(path), log_dir=str(tmp_path), names=("gateway",), ready=is_answering)
    with group:
        assert submit(address, 480, 832, longest).job_id, "the longest clip the plan holds is admitted"
        with pytest.raises(grpc.RpcError) as over:
            submit(address, 480, 832, longest + rules.FRAMES_PER_CHUNK)
        with pytest.raises(grpc.RpcError) as canvas:
            submit(address, 768, 1344, rules.VALID_NUM_FRAMES[0])
        http_port = load_deploy(path).gateway.http_port
        over_http = create(http_port, "832x480", (longest + rules.FRAMES_PER_CHUNK) / rules.FPS)
        canvas_http = create(http_port, "1344x768", rules.VALID_NUM_FRAMES[0] / rules.FPS)
    assert over.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert over.value.details().startswith(f"num_frames: 480x832 allows at most {longest} frames here: "), (
        over.value.details()
    )
    assert "plan's ceiling for 480x832x" in over.value.details() and "GPU 0 20 GiB" in over.value.details()
    assert canvas.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert canvas.value.details().startswith("height: 768x1344 allows no video here, not even 124 frames"), (
        canvas.value.details()
    )
    # the marker the HTTP door reads, on the gRPC refusal too: its reason and the field to change
    assert error_info.reason(over.value) == (error_info.OVER_CAPACITY, "num_frames")
    assert error_info.reason(canvas.value) == (error_info.OVER_CAPACITY, "height")
    # the HTTP door: 422 (well formed, over what this deployment holds) with the same ceiling, naming the field
    status, body = over_http
    assert status == 422 and body["error"]["param"] == "num_frames" and body["error"]["code"] == "invalid_argument"
    assert body["error"]["message"] == over.value.details() and body["error"]["type"] == "invalid_request_error"
    status, body = canvas_http
    assert (status, body["error"]["param"], body["error"]["message"]) == (422, "height", canvas.value.details())
    log = (tmp_path / "gateway.log").read_text()
    assert "t2va at 768x1344: [gateway] max_rows 200,000 admits 345 frames, the plan holds no clip" in log


def test_a_hand_set_table_overrides_the_plan_and_max_rows_still_bounds(tmp_path):
    from h3serve.gateway.admission.capacity import CapacityTable, OverCapacity

    config = load_deploy(small_card(tmp_path, 20.0))
    ceilings = Ceilings(config)
    request = gateway_pb2.ResolvedRequest(height=768, width=1344, num_frames=124, text_rows=PROMPT_ROWS, workflow=1)
    with pytest.raises(OverCapacity, match="plan's ceiling for 768x1344x124"):
        CapacityTable({}, None, ceilings).admit(request)
    measured = CapacityTable({"t2va": {"768x1344": 40_000}}, None, ceilings)
    assert measured.admit(request).total == 37_710 + PROMPT_ROWS, "a measured entry is the user's word"
    with pytest.raises(OverCapacity, match="max_rows is 30,000"):
        CapacityTable({"t2va": {"768x1344": 40_000}}, 30_000, ceilings).admit(request)


@pytest.mark.processes
def test_a_card_that_holds_not_even_the_smallest_clip_is_refused_with_the_plans_reason(tmp_path):
    path = small_card(tmp_path, 4.0)
    with pytest.raises(ConfigError, match=r"not even a 32x32 clip of 124 frames fits .*GPU 0: dit rank 0 .* over the"):
        require_holding(load_deploy(path), str(path))
    require_holding(load_deploy(small_card(tmp_path, 20.0)), None)  # holds some canvases: starts
    group = ServiceGroup(load_deploy(path), str(path), log_dir=str(tmp_path), names=("gateway",), ready=is_answering)
    with pytest.raises(RuntimeError, match="gateway refused to start"), group:
        pass
    assert "not even a 32x32 clip of 124 frames fits" in (tmp_path / "gateway.log").read_text()


@pytest.mark.processes
@pytest.mark.parametrize("profile", PROFILES, ids=[path.stem for path in PROFILES])
def test_plan_accepts_every_shipped_profile_and_prints_its_largest_requests(profile):
    command = [sys.executable, "-m", "h3serve.cli", "plan", "--config", str(profile), "--host-gib", "512"]
    out = subprocess.run(command, capture_output=True, text=True)
    lines = out.stdout.splitlines()
    heading = next(i for i, line in enumerate(lines) if line.startswith("largest request per workflow"))
    config = load_deploy(profile)
    if profile.stem == "tiny-cpu":
        assert "not bounded by the plan (no model service is on a GPU)" in lines[heading]
        return
    workflows = [line.split()[0] for line in lines[heading + 1 : heading + 1 + len(config.dit.workflows)]]
    assert workflows == list(config.dit.workflows) and lines[-1] in ("fits", "does not fit: 1 problem(s)")
    assert out.returncode == 0, out.stderr
    assert "768x1344: up to" in out.stdout or profile.stem == "turing-4x22"


def test_the_one_h100_profile_plans_its_ceiling_not_the_longest_clip():
    """The hand-composed layout was refused at 277 frames of 768x1344; bounded by the plan, it fits, and its 5 s
    clips at both usual sizes are admitted."""
    config = load_deploy(ROOT / "docs" / "deploy" / "single-h100.toml")
    ceilings = Ceilings(config)
    assert ceilings.bounded and ceilings.refusal() is None
    for height, width in ((768, 1344), (480, 832)):
        assert ceilings.ceiling("t2va", height, width).frames >= rules.VALID_NUM_FRAMES[0]
    assert rules.VALID_NUM_FRAMES[0] <= ceilings.largest_frames() < rules.VALID_NUM_FRAMES[-1]


def test_capacity_prints_the_plans_ceilings_beside_the_hand_set_table(capsys):
    """The multi-GPU profile names its cards ([supervisor] gpu_memory_gib), so the plan bounds it; `h3serve capacity`
    prints the ceilings the gateway admits by, after its (absent) table and max_rows."""
    profile = ROOT / "docs" / "deploy" / "h200x4.toml"
    config = load_deploy(profile)
    assert config.supervisor.gpu_memory_gib == 139.8
    ceilings = Ceilings(config, text_rows=256)
    assert ceilings.bounded and ceilings.ceiling("t2va", 768, 1344).frames is not None
    capacity._run(argparse.Namespace(config=str(profile), text_rows=256))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        "no capacity table in this deployment ([gateway] capacity): the plan's ceilings (below) and max_rows bound a "
        "request"
    )
    assert lines[-len(ceilings.lines()) :] == ceilings.lines()
    assert "GPU 3 139.8 GiB ([supervisor] gpu_memory_gib)" in lines[-4] and "768x1344: up to" in lines[-3]
