"""bench.plan_check: `h3serve plan` beside the peaks the lent GPUs measured for the shipped profiles (the committed
rows of bench/results.json), so a change to the plan's constants that moves it away from a measurement fails here."""

from __future__ import annotations

import tempfile
from pathlib import Path

from bench import plan_check


def test_the_one_h100_profile_is_planned_within_the_bar_of_its_busiest_run_and_no_dit_below_its_measured_peak(
    capsys,
):
    every = plan_check.main([])
    checks = [c for c in every if c.profile == "docs/deploy/single-h100.toml"]
    sizes = {str(c.size) for c in checks}
    assert sizes == {"768x1344x124", "480x832x124"}
    for size in sizes:  # the run that reached the card's busiest moment (a first start's compile) within the bar
        runs = [c for c in checks if str(c.size) == size]
        busiest = max(runs, key=lambda c: c.measured)
        assert abs(busiest.off) <= plan_check.BAR, busiest.row()
        assert all(c.off >= -plan_check.BAR for c in runs), "no run more than the bar above its plan"
    # the DiT, whose plan sets the admission ceilings, is never planned below its own measured peak, in any profile
    for c in every:
        assert c.planned_parts["dit"] >= c.measured_parts["dit"], c.row()
    out = capsys.readouterr().out
    assert "| planned - measured |" in out and "within 10% of the measured peak" in out


def test_a_row_is_rebuilt_from_its_own_command_with_the_lora_it_served():
    row = {
        "name": "e2e_480x832x124_4steps",
        "date": "2026-12-07",
        "device": "1xH100 80GB HBM3",
        "variant": "gRPC services, deployment docs/deploy/single-h100.toml as shipped",
        "peak_gib": 70.0,
        "rank_peaks_gib": [49.1],
        "process_peaks_gib": {"encoder": 3.28, "vae": 12.14},
        "command": "python -m bench.e2e --side in-process --sizes 480x832x124; python -m bench.e2e --side services "
        "--deploy docs/deploy/single-h100.toml --sizes 480x832x124 --adapter-rank 128 (a note)",
    }
    with tempfile.TemporaryDirectory() as work:
        with_lora = plan_check.check(row, Path(work))
        row["command"] = row["command"].replace(" --adapter-rank 128", "")
        without = plan_check.check(row, Path(work))
    # the rank-128 LoRA's bf16 factors on every block linear (2.42 GiB: bench.adapters.write_lora's file weighs
    # 2,603,513,024 bytes, header included) and the allocator's share of them on the DiT, nothing elsewhere
    lora = plan_check.lora_bytes(128)
    assert abs(lora - 2_603_513_024) < 100_000
    assert lora / 2**30 <= with_lora.planned_parts["dit"] - without.planned_parts["dit"] <= 1.1 * lora / 2**30
    assert with_lora.planned_parts["vae"] == without.planned_parts["vae"]
    assert with_lora.measured_parts == {"encoder": 3.28, "vae": 12.14, "dit": 49.1}
    assert abs(without.off - (without.planned - 70.0) / 70.0) < 1e-12
