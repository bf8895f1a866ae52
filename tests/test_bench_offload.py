"""bench.e2e's in-process baseline with diffusers' own CPU offload (--in-process-offload), on the tiny model: leaf-level
group offload runs on the CPU and denoises exactly what the plain pipeline does; the auto offload of a
ComponentsManager is refused there by diffusers itself (it asks the device for its free memory), named; the saved
baseline, the rows and the table name the offload, and a services run of another offload refuses the baseline."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from bench import e2e
from bench.common import Size
from bench.media_diff import FramesDiff, MediaDiff

pytestmark = pytest.mark.processes  # the in-process side runs in a spawned process of its own

SIZE = Size(32, 64, 124)  # --quick's


def in_process(tmp_path, offload: str) -> list:
    argv = ["--quick", "--side", "in-process", "--repeats", "1", "--in-process-offload", offload]
    paths = ["--out", str(tmp_path / offload), "--baseline-file", str(tmp_path / f"{offload}.json")]
    return e2e.main([*argv, *paths])


def quick_args(offload: str):
    """bench.e2e's arguments as its main sets them for --quick."""
    args = e2e.parser().parse_args(["--quick", "--in-process-offload", offload])
    vars(args).update(sizes=str(SIZE), dtype="float32", model_dir="", command="python -m bench.e2e ...", cache_state="")
    return args


@pytest.fixture(scope="module")
def baselines(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("offload")
    for offload in ("none", "sequential"):
        assert in_process(tmp_path, offload) == []
    return tmp_path


def test_sequential_offload_denoises_exactly_what_the_plain_pipeline_does_and_the_baseline_names_it(baselines):
    plain = np.load(baselines / "none" / f"in-process-{SIZE}.npz")
    offloaded = np.load(baselines / "sequential" / f"in-process-{SIZE}.npz")
    np.testing.assert_array_equal(offloaded["frames"], plain["frames"])
    np.testing.assert_array_equal(offloaded["audio"], plain["audio"])
    saved = json.loads((baselines / "sequential.json").read_text())
    assert saved["setup"]["in_process_offload"] == "sequential"
    assert "--in-process-offload sequential" in saved["command"]


def test_a_services_run_of_another_offload_refuses_the_baseline(baselines):
    args = quick_args("none")
    with pytest.raises(SystemExit, match="ran diffusers in process with --in-process-offload sequential, this run "):
        e2e.load_baseline(baselines / "sequential.json", args)
    args.in_process_offload = "sequential"
    sides, _ = e2e.load_baseline(baselines / "sequential.json", args)
    assert set(sides) == {SIZE}
    saved = json.loads((baselines / "none.json").read_text())  # as saved before the options existed: none, 3GB
    del saved["setup"]["in_process_offload"], saved["setup"]["offload_margin"]
    (baselines / "older.json").write_text(json.dumps(saved))
    with pytest.raises(SystemExit, match="--in-process-offload none, this run names sequential"):
        e2e.load_baseline(baselines / "older.json", args)
    args.in_process_offload = "none"
    assert set(e2e.load_baseline(baselines / "older.json", args)[0]) == {SIZE}


def test_a_model_offload_margin_is_part_of_the_baseline_and_named_in_its_rows(tmp_path):
    """--offload-margin: the room diffusers' auto offload keeps beside the model it moves in (the user's answer to the
    out-of-memory its default met at 768x1344x124 on one H100); a baseline of another margin is refused, and the rows
    name a margin other than diffusers' default."""
    args = quick_args("model")
    side = e2e.Side(seconds=2.5, stages=dict.fromkeys(e2e.STAGES, 0.5), transport=0.5, digest="ab", used_gib=1.0)
    e2e.save_baseline(tmp_path / "model.json", args, {SIZE: side})
    args.offload_margin = "12GB"
    with pytest.raises(SystemExit, match="'offload_margin': '3GB'.*this run is .*'offload_margin': '12GB'"):
        e2e.load_baseline(tmp_path / "model.json", args)
    [row, *_] = e2e.records(SIZE, side, side, args, "cpu", args.command)
    assert "(ComponentsManager.enable_auto_cpu_offload, memory_reserve_margin 12GB) + the same MP4 mux" in row.baseline
    args.offload_margin = "3GB"
    [row, *_] = e2e.records(SIZE, side, side, args, "cpu", args.command)
    assert "(ComponentsManager.enable_auto_cpu_offload) + the same MP4 mux" in row.baseline


def test_the_rows_and_the_table_name_the_offload(baselines, capsys):
    args = quick_args("sequential")
    sides, _ = e2e.load_baseline(baselines / "sequential.json", args)
    side = sides[SIZE]
    comparison = e2e.Comparison(SIZE, side, side, MediaDiff(0, 0.0), FramesDiff(0.0, 0, 0.0))
    [row, *_] = e2e.records(SIZE, side, side, args, "cpu", args.command)
    assert "with diffusers' sequential CPU offload (apply_group_offloading, leaf level)" in row.baseline
    e2e.print_table([comparison], "in proc+seq")
    assert f"{SIZE!s:16} in proc+seq " in capsys.readouterr().out


def test_the_services_alone_write_their_rows_with_no_baseline(baselines):
    """--baseline-file none (where nothing in process fits the card): the same rows, baseline seconds and ratio 0,
    the baseline named as absent; the first request and start-to-ready rows with --warm-start's figures."""
    args = quick_args("sequential")
    sides, _ = e2e.load_baseline(baselines / "sequential.json", args)
    served = replace(sides[SIZE], first_s=3.5, ready_s=12.0)
    rows = {row.name: row for row in e2e.records(SIZE, served, None, args, "cpu", args.command)}
    name = f"e2e_{SIZE}_{args.steps}steps"
    assert set(rows) == {name, *(f"{name}_{s}" for s in (*e2e.STAGES, "transport", "first_request", "start_to_ready"))}
    assert {(r.baseline_seconds, r.ratio) for r in rows.values()} == {(0.0, 0.0)}
    assert rows[name].seconds == served.seconds and rows[f"{name}_first_request"].seconds == 3.5
    assert rows[f"{name}_start_to_ready"].seconds == 12.0
    assert rows[name].baseline == "none in this run (--baseline-file none: the services alone)"


def test_model_offload_on_the_cpu_is_refused_by_diffusers_and_the_refusal_names_the_option(tmp_path):
    """diffusers' ComponentsManager.enable_auto_cpu_offload asks the device for its free memory first; a CPU has no
    answer, so the bench says which option diffusers refused and why, and saves no baseline."""
    with pytest.raises(SystemExit, match=r"--in-process-offload model: diffusers refuses it on cpu: .*mem_get_info"):
        in_process(tmp_path, "model")
    assert not (tmp_path / "model.json").exists()


@pytest.mark.parametrize("available_kib, refused", [(110 << 20, True), (124 << 20, False)])
def test_an_offloaded_full_size_baseline_is_refused_at_once_on_a_host_smaller_than_its_weights(
    tmp_path, available_kib, refused
):
    from bench import in_process_offload

    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       131000000 kB\nMemAvailable:   {available_kib} kB\n")
    need = in_process_offload.released_weights_gib("bfloat16")
    assert 110 < need < 124  # 61.7 transformer + 48.9 encoder + the VAEs: a 128 GB host just holds them
    refusal = rf"weights \({need:.1f} GiB\) load on the host first, and it has 110.0 GiB available"
    if refused:
        with pytest.raises(SystemExit, match=refusal):
            in_process_offload.refuse_a_small_host("model", "random:full", "bfloat16", str(meminfo))
    else:
        in_process_offload.refuse_a_small_host("model", "random:full", "bfloat16", str(meminfo))
    in_process_offload.refuse_a_small_host("none", "random:full", "bfloat16", str(meminfo))  # on the card: no check
    in_process_offload.refuse_a_small_host("model", "", "bfloat16", str(meminfo))  # the tiny preset: no check


def test_an_in_process_call_cut_short_keeps_the_sizes_it_finished(tmp_path):
    """A 10-minute device call holds about one full-size offloaded size: each is saved as it is measured, so the
    size after a cut (here: a request the pipeline refuses) costs only itself."""
    with pytest.raises(ValueError, match="num_frames"):
        e2e._in_process([SIZE, Size(32, 64, 0)], quick_args("none"), "cpu", tmp_path, tmp_path / "baseline.json")
    saved = json.loads((tmp_path / "baseline.json").read_text())
    assert list(saved["sides"]) == [str(SIZE)] and saved["setup"]["sizes"] == str(SIZE)
    kept = np.load(tmp_path / f"baseline-{SIZE}.npz")
    np.testing.assert_array_equal(kept["frames"], np.load(tmp_path / f"in-process-{SIZE}.npz")["frames"])
