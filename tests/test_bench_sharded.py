"""The sharded-DiT benchmark harness in its --quick CPU mode (2 gloo ranks); GPU numbers come from real runs."""

from __future__ import annotations

import json

import pytest
import torch
from forked import run_ranks

from bench import dit_sharded

pytestmark = [pytest.mark.distributed, pytest.mark.processes]


def test_quick_sharded_bench_writes_a_record_per_size_with_each_ranks_peak(tmp_path):
    results, markdown = tmp_path / "results.json", tmp_path / "BENCHMARKS.md"
    dit_sharded.main(["--quick", "--forwards", "3", "--write", "--results", str(results), "--markdown", str(markdown)])
    [record] = json.loads(results.read_text())
    assert (record["name"], record["device"], record["world_size"], record["dtype"]) == (
        "dit_sharded_32x64x124",
        "2xcpu",
        2,
        "float32",
    )
    assert record["variant"] == "group: ulysses 2, replicated, native"
    assert record["seconds"] > 0 and record["ratio"] == record["baseline_seconds"] / record["seconds"]
    assert len(record["rank_peaks_gib"]) == 2 and record["peak_gib"] == max(record["rank_peaks_gib"])
    assert record["command"].startswith("python -m bench.dit_sharded --quick")
    assert "| dit_sharded_32x64x124 | 2xcpu | float32 |" in markdown.read_text()


def test_quick_check_compares_every_split_with_one_rank(tmp_path, fork_server):
    # the check's ranks as forks (forked.run_ranks), their imports done; the test above launches torchrun
    out = tmp_path / "rows.json"
    run_ranks(fork_server, "bench.dit_sharded", ["--quick", "--check", "--out", str(out)])
    rows = json.loads(out.read_text())
    assert [row["variant"] for row in rows] == [
        "ulysses 2, replicated",
        "ulysses 2, FSDP2",
        "ring 2, replicated",
        "ring 2, FSDP2",
    ]
    for row in rows:
        assert "error" not in row, row
        assert row["latents_max_abs"] <= 1e-5 and row["audio_latents_max_abs"] <= 1e-5, row


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
def test_nccl_two_ranks_match_one_rank_on_a_mid_size_model():
    exact = dit_sharded.main(["--check", "--world-size", "2"])  # fp32, native: Ulysses; ring needs an LSE kernel
    for row in exact[:2]:
        assert row["latents_max_rel"] <= 1e-4 and row["audio_latents_max_rel"] <= 1e-4, row
    assert all("return_lse" in row["error"] for row in exact[2:]), exact[2:]
    bf16 = dit_sharded.main(
        ["--check", "--world-size", "2", "--dtype", "bfloat16", "--attention-backend", "_native_cudnn"]
    )
    for row in bf16:
        assert "error" not in row and row["latents_max_rel"] <= 2e-2, row
