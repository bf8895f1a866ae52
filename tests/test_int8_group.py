"""int8 block weights under FSDP2 (`[dit] weights = "int8"`): 2 CPU ranks (gloo) that each quantise only their rows
while loading give the latents of one rank that loads the model whole and quantises it (tests/int8_group_checks.py)."""

from __future__ import annotations

import json

import pytest
from forked import run_ranks

pytestmark = pytest.mark.processes
# each rank quantises its rows of a weight with the scale of each row, as one rank does for all rows: the int8 values
# are identical, and the split changes only the order of floating-point sums (bf16 on the CPU here)
TOLERANCE = 1e-3  # measured: 1.9e-4


@pytest.fixture(scope="module")
def report(tmp_path_factory, fork_server, tiny_model_dir) -> dict:
    out = tmp_path_factory.mktemp("int8-group") / "checks.json"
    run_ranks(fork_server, "tests.int8_group_checks", [str(out), str(tiny_model_dir)])
    return json.loads(out.read_text())


@pytest.mark.distributed
def test_an_int8_fsdp2_group_gives_the_one_rank_int8_latents(report):
    assert report["finite"]
    assert report["max_diff"] <= TOLERANCE, report["max_diff"]


@pytest.mark.distributed
def test_each_rank_holds_its_rows_of_the_int8_weights_and_their_scales(report):
    assert report["block_linear"] == ["torch.int8", "torch.float32"]
    assert report["rows_per_rank"] == [16, 16], "ff.net.2's 32 output rows, half a rank"
