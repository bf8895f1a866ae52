"""Packed-sequence rows and the capacity table; the `capacity` command as a user runs it (a process)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from h3serve.gateway.admission.capacity import CapacityTable, OverCapacity, packed_rows
from h3serve.model.rules import Rows
from h3serve.v1 import common_pb2, gateway_pb2


def test_rows_match_the_model_layout():
    # docs/model.md, "Packed rows": t2va at 124 frames is T + 37,710 at 768x1344 and T + 14,844 at 480x832.
    assert packed_rows(768, 1344, 124, text_rows=100) == Rows(text=100, audio=414, video=37_296)
    assert packed_rows(768, 1344, 124, 100).total == 37_810
    assert packed_rows(480, 832, 124, 0).total == 14_844
    # fl2va first+last keyframe at 768x1344: two keyframes of 1008 rows each (their vision tokens are text rows).
    assert packed_rows(768, 1344, 124, 100, condition_rows=2 * 1008).total == 39_826


def _request(height, width, num_frames, text_rows=5, workflow=common_pb2.WORKFLOW_T2VA, condition_rows=0):
    return gateway_pb2.ResolvedRequest(
        prompt="a fox",
        height=height,
        width=width,
        num_frames=num_frames,
        workflow=workflow,
        text_rows=text_rows,
        condition_rows=condition_rows,
    )


def test_capacity_refuses_with_the_frame_ceiling():
    table = CapacityTable({"t2va": {"768x1344": 200_000, "*": 60_000}})
    assert table.admit(_request(768, 1344, 345)).total == 1150 + 102 * 1008 + 5
    # Any other canvas falls back to "*"; 1344x768 has 1008 rows per latent frame like 768x1344.
    with pytest.raises(OverCapacity) as err:
        table.admit(_request(1344, 768, 345))
    message = err.value.message
    assert message.startswith(
        "num_frames: 1344x768 allows at most 192 frames here: 345 frames need 103,971 packed rows"
    ), message
    assert "capacity at 1344x768 is 60,000" in message
    assert packed_rows(1344, 768, 192, 5).total <= 60_000 < packed_rows(1344, 768, 209, 5).total
    with pytest.raises(OverCapacity, match="^height: 768x1344 allows no video here, not even 124 frames"):
        CapacityTable({"t2va": {"768x1344": 1000}}).admit(_request(768, 1344, 124))
    assert CapacityTable({}).admit(_request(768, 1344, 345)).total > 0, "no table: no limit"


def test_conditioning_rows_count_against_capacity():
    table = CapacityTable({"fl2va": {"768x1344": 40_000}})
    request = _request(768, 1344, 124, text_rows=100, workflow=common_pb2.WORKFLOW_FL2VA, condition_rows=1008)
    assert table.admit(request).total == 38_818
    request.condition_rows = 4 * 1008
    with pytest.raises(OverCapacity, match="conditioning 4032"):
        table.admit(request)


def test_text_rows_count_against_capacity():
    # The vision tokens of keyframes / references are text rows: a request whose text alone is large is refused.
    table = CapacityTable({"t2va": {"480x832": 16_000}})
    assert table.admit(_request(480, 832, 124, text_rows=1156)).total == 16_000
    with pytest.raises(OverCapacity, match=r"^height: 480x832 allows no video here.*\(text 1157, "):
        table.admit(_request(480, 832, 124, text_rows=1157))


def test_max_rows_bounds_every_workflow_and_canvas():
    table = CapacityTable({"t2va": {"*": 10**6}}, max_rows=40_000)
    request = _request(768, 1344, 124, workflow=common_pb2.WORKFLOW_REF2VA)
    assert table.admit(request).total == 37_715
    request.num_frames = 141
    with pytest.raises(OverCapacity) as err:
        table.admit(request)
    # 141 frames: 42 latent frames x 1008 rows.
    assert err.value.message == (
        "num_frames: 768x1344 allows at most 124 frames here: 141 frames need 42,811 packed "
        "rows (text 5, audio 470, video 42336, conditioning 0), this deployment's max_rows "
        "is 40,000"
    )


@pytest.mark.parametrize(
    "limits", [{"t3va": {"*": 1}}, {"t2va": {"768*1344": 1}}, {"t2va": {"*": 0}}, {"t2va": {"*": "many"}}]
)
def test_a_bad_table_is_refused(limits):
    with pytest.raises(ValueError, match="capacity"):
        CapacityTable(limits)


@pytest.mark.processes
def test_capacity_command_prints_the_table(tmp_path):
    config = tmp_path / "deploy.toml"
    config.write_text('[gateway.capacity.t2va]\n"768x1344" = 38000\n"480x832" = 14000\n')
    out = subprocess.run(
        [sys.executable, "-m", "h3serve.cli", "capacity", "--config", str(config), "--text-rows", "100"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["workflow", "canvas", "max", "rows"]
    assert lines[1].split() == ["t2va", "480x832", "14,000", "none", "fit"]
    assert lines[2].split() == ["t2va", "768x1344", "38,000", "124"]
