"""The benchmark harness itself, in its --quick CPU mode (the GPU numbers come from real runs)."""

from __future__ import annotations

import json

from bench import dit_step


def test_quick_dit_step_writes_consistent_records(tmp_path):
    results, markdown = tmp_path / "results.json", tmp_path / "BENCHMARKS.md"
    args = ["--quick", "--repeats", "1", "--errors", "--write", "--results", str(results), "--markdown", str(markdown)]
    dit_step.main(args)
    dit_step.main(args)  # a second run replaces its records instead of appending
    records = json.loads(results.read_text())
    assert [r["name"] for r in records] == ["dit_step_32x64x124"]
    record = records[0]
    assert record["ratio"] == record["baseline_seconds"] / record["seconds"] > 0
    assert record["device"] == "cpu" and record["dtype"] == "float32" and "--quick" in record["command"]
    # In fp32 the replayed forward is the fp32 reference itself: any difference is a harness bug.
    assert record["rel_err_fp32"] == record["bf16_rel_err_fp32"] == 0.0 and record["rel_err_bf16"] is None
    assert "| dit_step_32x64x124 | cpu | float32 |" in markdown.read_text()
    assert "0.00e+00 (0.00e+00)" in markdown.read_text()


def test_quick_vae_decode_times_each_variant_against_the_block(tmp_path):
    from bench import vae_decode

    results, markdown = tmp_path / "results.json", tmp_path / "BENCHMARKS.md"
    vae_decode.main(["--quick", "--repeats", "1", "--errors", "--variants", "native,native+tiles=2", "--write",
                     "--results", str(results), "--markdown", str(markdown)])
    records = json.loads(results.read_text())
    assert [r["variant"] for r in records] == ["VAE service decoder, native", "VAE service decoder, native+tiles=2"]
    # fp32 weights: the decode is its own fp32 reference.
    assert all(r["name"] == "vae_decode_32x64x22" and r["rel_err_fp32"] == 0.0 for r in records)
