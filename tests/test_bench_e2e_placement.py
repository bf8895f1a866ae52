"""bench.e2e over several GPUs: where the services go, what it refuses before loading, and a real 2-rank run.

The placement is checked through the deployment file the bench writes (read back by the services' own
loader); the run starts the real services with a 2-rank gloo DiT group on the CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import e2e
from bench.common import Size
from bench.placement import Placement
from h3serve.common.config import load_deploy


def placed(tmp_path, gpus: int, placement: str = "shared", fsdp: str = "off"):
    args = e2e.parser().parse_args(
        ["--dit", "_native_cudnn", "--gpus", str(gpus), "--placement", placement, "--dit-fsdp", fsdp]
    )
    return load_deploy(e2e.deployment(args, "cuda", tmp_path))


def test_shared_placement_spans_every_gpu_with_the_dit_and_puts_encoder_and_vae_beside_its_ranks(tmp_path):
    config = placed(tmp_path, 4)
    assert (config.encoder.gpus, config.dit.gpus, config.vae.gpus) == ("0", "0,1,2,3", "3")
    dit = config.dit
    assert (dit.world_size, dit.ulysses_degree, dit.ring_degree, dit.fsdp) == (4, 0, 1, False)  # 0: Ulysses 4
    assert {config.encoder.device, config.dit.device, config.vae.device} == {"cuda"}
    config = placed(tmp_path, 2, fsdp="on")
    assert (config.encoder.gpus, config.dit.gpus, config.vae.gpus) == ("0", "0,1", "1")
    assert (config.dit.world_size, config.dit.fsdp) == (2, True)


def test_dedicated_placement_is_the_deployment_files_layout(tmp_path):
    config = placed(tmp_path, 4, "dedicated")
    documented = load_deploy(Path(__file__).parents[1] / "docs/deploy/h200x4.toml")
    for name in ("encoder", "dit", "vae"):
        assert config.service(name).gpus == documented.service(name).gpus, name
    assert (config.dit.world_size, config.dit.fsdp) == (documented.dit.world_size, documented.dit.fsdp) == (2, False)
    with pytest.raises(ValueError, match="'dedicated' needs at least 3 GPUs .*got 2"):
        Placement.plan(2, "dedicated")


def test_the_records_name_each_sides_devices():
    assert Placement.plan(1).describe() == "one device"  # the one-device records keep their key
    assert (
        Placement.plan(4).describe() == "4 GPUs; encoder GPU 0, DiT Ulysses 4 on GPUs 0,1,2,3 (replicated), VAE GPU 3"
    )
    assert Placement.plan(2, fsdp=True, cuda=False).describe() == "CPU; DiT 2 gloo ranks (Ulysses 2, FSDP2)"


def test_a_backend_a_dit_group_cannot_split_the_sequence_with_is_refused_before_anything_loads(tmp_path):
    # _native_math runs one rank; diffusers has no context parallelism for it.
    out = tmp_path / "run"
    with pytest.raises(
        SystemExit,
        match="DiT service would refuse to start .*2 gloo ranks.*'_native_math' cannot split the sequence across ranks",
    ):
        e2e.main(["--quick", "--gpus", "2", "--dit", "_native_math", "--out", str(out)])
    assert not list(out.glob("*.mp4")) and not list(out.glob("*.log"))  # neither side started
    args = e2e.parser().parse_args(["--quick", "--model-dir", "", "--dtype", "float32", "--dit", "_native_math"])
    e2e.refuse_early(
        load_deploy(e2e.deployment(args, "cpu", tmp_path)),
        Placement.plan(1),
        "cpu",
    )


def test_more_gpus_than_visible_and_an_impossible_layout_are_refused_before_anything_loads(tmp_path):
    with pytest.raises(SystemExit, match="--gpus 64, but .* GPU\\(s\\) are visible"):
        e2e.main(["--gpus", "64", "--sizes", "32x64x124", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="'dedicated' needs at least 3 GPUs"):
        e2e.main(["--quick", "--gpus", "2", "--placement", "dedicated", "--out", str(tmp_path)])
    assert not list(tmp_path.glob("*.mp4"))


@pytest.mark.processes
@pytest.mark.distributed
def test_quick_e2e_with_a_two_rank_dit_group_against_a_saved_baseline_gives_the_in_process_video(tmp_path):
    # As on the GPUs: the one-device baseline in one call, then the services over "2 GPUs" in the next.
    results, markdown, baseline = tmp_path / "results.json", tmp_path / "BENCHMARKS.md", tmp_path / "base.json"
    common = ["--quick", "--repeats", "1", "--baseline-file", str(baseline)]
    assert e2e.main([*common, "--side", "in-process", "--out", str(tmp_path / "one")]) == []
    assert all(e2e.baseline_output(baseline, Size(32, 64, 124), suffix).exists() for suffix in (".mp4", ".npz"))
    [comparison] = e2e.main(
        [
            *common,
            "--gpus",
            "2",
            "--side",
            "services",
            "--out",
            str(tmp_path / "two"),
            "--write",
            "--results",
            str(results),
            "--markdown",
            str(markdown),
        ]
    )
    # Two ranks compute the request within float rounding of one (tests/test_dit_group.py: 1e-5): the
    # decoded pictures are the same; AAC turns the tiny audio differences into slightly larger ones.
    assert comparison.media.video_levels == 0
    assert comparison.media.audio < 0.05
    assert comparison.frames.frames < 1e-4 and comparison.frames.levels <= 1 and comparison.frames.audio < 1e-4
    served = comparison.served
    assert len(served.rank_peaks_gib) == 2 and all(peak > 0 for peak in served.rank_peaks_gib)
    total = json.loads(results.read_text())[0]
    assert (total["device"], total["world_size"], total["rank_peaks_gib"]) == ("cpu", 2, served.rank_peaks_gib)
    assert "DiT 2 gloo ranks (Ulysses 2, replicated)" in total["variant"]
    assert total["ratio"] == comparison.in_process.seconds / served.seconds
    assert "--side in-process" in total["command"] and "--gpus 2 --side services" in total["command"]
