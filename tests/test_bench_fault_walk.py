"""bench.fault_walk, the fault walk as a benchmark: its --quick CPU mode end to end, and what it refuses before it
starts anything (the GPU numbers come from real runs)."""

from __future__ import annotations

import json

import pytest

from bench import fault_walk


@pytest.mark.processes
def test_quick_walk_kills_the_gateway_and_counts_every_acknowledged_job_done(tmp_path):
    results, markdown = tmp_path / "results.json", tmp_path / "BENCHMARKS.md"
    walk = fault_walk.main(
        [
            *("--quick", "--victim", "gateway", "--jobs", "2", "--out", str(tmp_path / "run")),
            *("--write", "--results", str(results), "--markdown", str(markdown)),
        ]
    )
    counts = dict(acknowledged=2, succeeded=2, failed=0, lost=0, unfinished=0, attempts=2)
    assert walk.jobs == counts, walk.errors  # a gateway restart spends no attempt of a job
    (kill,) = walk.kills
    assert kill.back_s is not None and kill.back_s > 0 and kill.pid_after not in (None, kill.pid), kill
    assert walk.last_job_s is not None and walk.up_exit == 0 and walk.fp8 is None
    assert (tmp_path / "run" / "logs" / "gateway.log").is_file()
    (saved,) = json.loads(results.read_text())
    assert saved["name"] == "fault_walk_gateway_32x64x124_2steps" and saved["jobs"] == counts
    assert saved["back_seconds"] == [kill.back_s] and saved["seconds"] == walk.last_job_s
    section = markdown.read_text().split("## Fault walks")[1]
    assert "| fault_walk_gateway_32x64x124_2steps | cpu | float32 | " in section
    assert "| 2 | 2 | 0 | 0 | 0 | 2 | " in section


FP8, COMPILING = fault_walk.FP8_SAVE, fault_walk.COMPILING


@pytest.mark.parametrize(
    "victim, options, reason",
    [
        (FP8, ["--quick", "--dit", "native+fp8"], "needs a GPU: torchao refuses fp8 on a CPU"),
        (FP8, ["--dit", "native+compile"], "--dit native\\+compile has no \\+fp8"),
        (FP8, ["--dit", "native+fp8"], "needs --fp8-cache DIR, an empty directory"),
        (
            FP8,
            ["--dit", "native+fp8", "--fp8-cache", "{cache}"],
            "fp8-cache .* is not empty \\(transformer-fp8-0123\\)",
        ),
        (COMPILING, ["--quick", "--dit", "native"], "give --dit with \\+compile"),
        (COMPILING, ["--quick", "--dit", "native+compile"], "needs --compile-cache DIR, an empty directory"),
        (COMPILING, ["--quick", "--dit", "native+compile", "--compile-cache", "{cache}"], "needs --compile-cache DIR"),
    ],
)
def test_a_kill_at_a_moment_that_cannot_come_is_refused_before_anything_starts(victim, options, reason, tmp_path):
    """An fp8 save (a GPU, fp8 and an empty fp8 cache) or a compile into an empty compile cache, as the victim needs."""
    cache, out = tmp_path / "cache", tmp_path / "out"
    (cache / "transformer-fp8-0123").mkdir(parents=True)  # a cache that is not empty
    argv = ["--victim", victim, "--out", str(out), *(o.format(cache=cache) for o in options)]
    with pytest.raises(SystemExit, match=reason):
        fault_walk.main(argv)
    assert not out.exists(), "nothing written, nothing started"


def test_a_walk_into_an_earlier_runs_directory_is_refused(tmp_path):
    (tmp_path / "up.out").write_text("an earlier walk")
    with pytest.raises(SystemExit, match="holds an earlier run"):
        fault_walk.main(["--quick", "--victim", "gateway", "--out", str(tmp_path)])
