"""The benchmark harness itself, in its --quick CPU mode (the GPU numbers come from real runs); the tests that run a
bench or a stand-in nvidia-smi are marked `processes`, the rest are in the unit tier."""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bench import common, dit_step


@pytest.mark.processes
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
    assert record["tflops"] > 0 and record["ceiling_tflops"] > 0
    # In fp32 the replayed forward is the fp32 reference itself: any difference is a harness bug.
    assert record["rel_err_fp32"] == record["bf16_rel_err_fp32"] == 0.0 and record["rel_err_bf16"] is None
    assert "| dit_step_32x64x124 | cpu | float32 |" in markdown.read_text()
    assert "0.00e+00 (0.00e+00)" in markdown.read_text()


@pytest.mark.processes
def test_quick_gguf_step_times_each_weight_format_against_bf16(tmp_path):
    from bench import gguf_step

    results, markdown, files = tmp_path / "results.json", tmp_path / "BENCHMARKS.md", tmp_path / "gguf"
    outputs = ["--write", "--results", str(results), "--markdown", str(markdown)]
    records = gguf_step.main(["--quick", "--weights", "fp8,Q4_0,Q8_0", "--dir", str(files), *outputs])
    assert [r.variant.split(":")[0] for r in records] == ["bf16", "Q8_0", "Q4_0"], "bf16 always; fp8 needs a GPU"
    bf16, q8, q4 = records
    assert bf16.ratio == 1.0 and bf16.rel_err_bf16 is None and bf16.file_gib is None
    assert all(r.baseline_seconds == bf16.seconds and r.ratio == bf16.seconds / r.seconds for r in records)
    # one forward of the tiny model in float32: measured 5.3e-3 (Q8_0) and 9.1e-2 (Q4_0)
    assert 0 < q8.rel_err_bf16 < 0.02 and q8.rel_err_bf16 < q4.rel_err_bf16 < 0.25
    assert bf16.weights_gib > q8.weights_gib > q4.weights_gib > 0 and q8.file_gib > q4.file_gib > 0
    assert all(r.load_seconds > 0 and r.host_hwm_gib > 0.1 for r in records)
    assert list(files.iterdir()) == [], "each GGUF is deleted once loaded"
    section = markdown.read_text().split("## Weight formats")[1]
    assert section.count("| dit_step_weights_32x64x124 | cpu | float32 | ") == 3


@pytest.mark.processes
def test_quick_vae_decode_times_each_variant_against_the_block(tmp_path):
    from bench import vae_decode

    results, markdown = tmp_path / "results.json", tmp_path / "BENCHMARKS.md"
    vae_decode.main(
        [
            "--quick",
            "--repeats",
            "1",
            "--errors",
            "--variants",
            "native,native+tiles=2",
            "--write",
            "--results",
            str(results),
            "--markdown",
            str(markdown),
        ]
    )
    records = json.loads(results.read_text())
    assert [r["variant"] for r in records] == ["VAE service decoder, native", "VAE service decoder, native+tiles=2"]
    # fp32 weights: the decode is its own fp32 reference.
    assert all(r["name"] == "vae_decode_32x64x22" and r["rel_err_fp32"] == 0.0 for r in records)


def test_the_fp32_reference_puts_weights_and_buffers_back_in_their_dtypes():
    from bench.accuracy import upcast_to_fp32
    from h3serve.runtime.tiny import build_component

    vae = build_component("vae").to(torch.bfloat16)
    before = {name: (t.dtype, t.clone()) for name, t in [*vae.named_parameters(), *vae.named_buffers()]}
    assert any(name for name, _ in vae.named_buffers()), "the VAE has a buffer (its decoder's rope frequencies)"
    with upcast_to_fp32(vae):
        assert {t.dtype for t in [*vae.parameters(), *vae.buffers()]} == {torch.float32}
    after = dict([*vae.named_parameters(), *vae.named_buffers()])
    for name, (dtype, value) in before.items():
        assert after[name].dtype == dtype and torch.equal(after[name], value), name


def test_vae_variants_take_the_fast_path_flags_and_tiles():
    from bench.vae_decode import VaeVariant

    variant = VaeVariant.parse("_native_cudnn+compile+dynamic+tiles=28")
    assert (variant.fast.attention, variant.fast.compile, variant.fast.dynamic, variant.tile_batch) == (
        "_native_cudnn",
        True,
        True,
        28,
    )
    assert variant.describe() == "_native_cudnn+compile+dynamic+tiles=28"
    assert VaeVariant.parse("native+compile+fp8+tiles=4").describe() == "native+compile+fp8+tiles=4"
    with pytest.raises(SystemExit, match="unknown option"):
        VaeVariant.parse("native+channels_last")


@pytest.mark.processes
def test_quick_e2e_times_the_services_against_the_in_process_pipeline(tmp_path):
    from bench import e2e

    results, markdown = tmp_path / "results.json", tmp_path / "BENCHMARKS.md"
    old = {
        "name": "e2e_old",
        "device": "cpu",
        "world_size": 1,
        "dtype": "float32",
        "seconds": 1.0,
        "baseline_seconds": 1.0,
        "ratio": 1.0,
        "peak_gib": 0.0,
        "command": "c",
        "date": "2026-01-01",
        "variant": "v",
        "baseline": "b",
        "software": "s",
    }  # written before host memory was sampled
    results.write_text(json.dumps([old]))
    [comparison] = e2e.main(
        [
            "--quick",
            "--repeats",
            "1",
            "--out",
            str(tmp_path / "run"),
            "--write",
            "--results",
            str(results),
            "--markdown",
            str(markdown),
        ]
    )
    # The same request through the four processes and through MiniMaxH3Blocks: the same MP4, byte for byte,
    # from the same decoded frames and waveform, bit for bit.
    assert comparison.same_output
    assert (comparison.frames.frames, comparison.frames.levels, comparison.frames.audio) == (0.0, 0, 0.0)
    served, in_process = comparison.served, comparison.in_process
    assert all(served.stages[s] > 0 and in_process.stages[s] > 0 for s in e2e.STAGES)
    # The client's time spans every stage the gateway recorded for the job, plus the transport between them.
    assert served.transport > 0
    # Host memory from the start on: the services' four processes, the pipeline's child; each a python with torch
    # and the tiny model (over 100 MiB private), the files it maps apart
    assert served.host_peak_gib > in_process.host_peak_gib > 0.1
    assert served.host_file_gib > 0 and in_process.host_file_gib > 0
    old_row, *records = json.loads(results.read_text())
    assert old_row["name"] == "e2e_old" and old_row["host_peak_gib"] is None
    name = "e2e_32x64x124_4steps"
    assert [r["name"] for r in records] == [name, *(f"{name}_{s}" for s in (*e2e.STAGES, "transport"))]
    assert all(
        (r["host_peak_gib"], r["host_file_gib"], r["host_used_gib"])
        == (served.host_peak_gib, served.host_file_gib, served.host_used_gib)
        for r in records
    )
    total = records[0]
    assert (total["seconds"], total["baseline_seconds"]) == (served.seconds, in_process.seconds)
    assert total["ratio"] == in_process.seconds / served.seconds
    assert [r["seconds"] for r in records[1:5]] == [served.stages[s] for s in e2e.STAGES]
    assert f"| {name} | cpu | float32 |" in markdown.read_text()
    assert f"| {served.host_peak_gib:.1f} (+{served.host_file_gib:.1f}; system +" in markdown.read_text()
    assert "| 0.0 |  |" in markdown.read_text(), "the old row: peak GiB, then no host memory"
    assert {p.name for p in (tmp_path / "run").glob("*.mp4")} == {"in-process-32x64x124.mp4", "served-32x64x124.mp4"}
    assert {p.name for p in (tmp_path / "run").glob("*.npz")} == {"in-process-32x64x124.npz", "served-32x64x124.npz"}


def test_e2e_baseline_saved_by_one_call_is_only_used_by_a_run_of_the_same_setup(tmp_path):

    from bench import e2e
    from bench.common import Size

    args = argparse.Namespace(
        sizes="32x64x124,64x32x124",
        steps=4,
        warmup_steps=2,
        dtype="float32",
        model_dir="",
        adapter_rank=0,
        flow_shift=12.0,
        in_process_offload="none",
        offload_margin="3GB",
        command="python -m bench.e2e --quick --side in-process",
    )
    side = e2e.Side(seconds=2.5, stages={s: 0.5 for s in e2e.STAGES}, transport=0.5, digest="ab", used_gib=1.0)
    path = tmp_path / "baseline.json"
    with pytest.raises(SystemExit, match="no baseline at .*; run with --side in-process first"):
        e2e.load_baseline(path, args)
    both = {Size(32, 64, 124): side, Size(64, 32, 124): side}
    e2e.save_baseline(path, args, both)
    assert e2e.load_baseline(path, args) == (both, args.command)
    sampled = {size: replace(side, host_peak_gib=40.5, host_file_gib=38.0, host_used_gib=80.1) for size in both}
    e2e.save_baseline(tmp_path / "sampled.json", args, sampled)
    assert e2e.load_baseline(tmp_path / "sampled.json", args) == (sampled, args.command)
    assert sampled[Size(32, 64, 124)].host_text() == "host 40.5 GiB private (+38.0 mapped files), system used +80.1 GiB"
    saved = json.loads(path.read_text())  # as saved before host memory was sampled: loads, prints nothing
    for each in saved["sides"].values():
        del each["host_peak_gib"], each["host_file_gib"], each["host_used_gib"]
    (tmp_path / "unsampled.json").write_text(json.dumps(saved))
    assert e2e.load_baseline(tmp_path / "unsampled.json", args) == (both, args.command)
    assert side.host_text() == ""
    args.sizes = "64x32x124"  # one of its sizes: a call per size when device time is short
    assert e2e.load_baseline(path, args) == (both, args.command)
    args.sizes = "64x64x124"
    with pytest.raises(SystemExit, match="measured with"):
        e2e.load_baseline(path, args)
    args.sizes, args.adapter_rank = "32x64x124", 128
    with pytest.raises(SystemExit, match="'adapter_rank': 0.*this run is .*'adapter_rank': 128"):
        e2e.load_baseline(path, args)
    args.adapter_rank, args.steps = 0, 50
    with pytest.raises(SystemExit, match="measured with .*'steps': 4.*this run is .*'steps': 50"):
        e2e.load_baseline(path, args)
    # one call per size: a second size of the same setup joins the file, another setup replaces it
    args.steps, args.command = 4, "python -m bench.e2e --side in-process --sizes 32x64x124"
    one = tmp_path / "per-size.json"
    e2e.save_baseline(one, args, {Size(32, 64, 124): side})
    args.sizes, args.command = "64x32x124", "python -m bench.e2e --side in-process --sizes 64x32x124"
    faster = replace(side, seconds=1.5)
    e2e.save_baseline(one, args, {Size(64, 32, 124): faster})
    args.sizes = "32x64x124,64x32x124"
    expected = {Size(32, 64, 124): side, Size(64, 32, 124): faster}
    both_commands = "python -m bench.e2e --side in-process --sizes 32x64x124; " + args.command
    assert e2e.load_baseline(one, args) == (expected, both_commands)
    args.flow_shift, args.sizes = 6.0, "64x32x124"
    e2e.save_baseline(one, args, {Size(64, 32, 124): side})
    assert e2e.load_baseline(one, args) == ({Size(64, 32, 124): side}, args.command)


def test_e2e_deployment_puts_every_service_on_the_device_with_the_requested_fast_paths(tmp_path):
    from bench import e2e, served
    from h3serve.common.config import load_deploy
    from h3serve.runtime.fastpath import FastPath

    lora = tmp_path / "turbo.safetensors"
    lora.touch()
    args = e2e.parser().parse_args(
        ["--dit", "flash4+compile+fp8", "--vae", "native+compile+dynamic+fp8+tiles=28", "--sizes", "480x832x124"]
        + ["--compile-cache", str(tmp_path / "cc"), "--x264-preset", "veryfast"]
    )
    args.adapter_file = str(lora)  # as main writes it for --adapter-rank
    config = load_deploy(served.deployment(args, "cuda", tmp_path))
    assert config.dit.warmup == () and config.supervisor.start_timeout_s == 900
    assert config.dit.compile_cache_dir == config.vae.compile_cache_dir == str(tmp_path / "cc")
    assert {name: source.path for name, source in config.dit.adapters.items()} == {served.ADAPTER: str(lora)}
    services = [config.encoder, config.dit, config.vae]
    assert {(s.model_dir, s.device, s.dtype, s.gpus) for s in services} == {("random:full", "cuda", "bfloat16", "")}
    assert (config.dit.world_size, config.dit.fsdp) == (1, False)
    assert config.encoder.cache_bytes == 0 and config.dit.workflows == ("t2va",)
    assert FastPath.of(config.dit) == FastPath("flash4", compile=True, fp8=True)
    assert FastPath.of(config.vae) == FastPath("native", compile=True, dynamic=True, fp8=True)
    assert config.vae.tile_batch == 28
    assert (config.vae.x264_preset, config.vae.x264_threads) == ("veryfast", 0), "x264's own threads off --quick"
    assert [config.gateway.encoder, config.gateway.dit, config.gateway.vae] == [s.address for s in services]
    assert config.gateway.data_dir == str(tmp_path / "gateway")


def test_e2e_fp8_cache_reaches_the_dit_built_or_shipped_and_the_records_say_what_it_held(tmp_path):
    from bench import e2e, served
    from h3serve.common.config import load_deploy

    profile = Path(__file__).resolve().parents[1] / "docs" / "deploy" / "single-32gb.toml"
    fp8 = tmp_path / "fp8"
    args = e2e.parser().parse_args(
        ["--dit", "_native_cudnn+compile+fp8", "--warm-start", "--sizes", "480x832x124", "--fp8-cache", str(fp8)]
    )
    for deploy in (None, str(profile)):
        args.deploy = deploy
        assert load_deploy(served.deployment(args, "cuda", tmp_path)).dit.fp8_cache_dir == str(fp8)
    assert served.cache_state(args) == ", fp8 cache empty at start"
    fp8.mkdir()
    (fp8 / "transformer-fp8-0123.pt").write_bytes(bytes(3 << 20))
    args.compile_cache = str(tmp_path / "cc")
    assert served.cache_state(args) == ", compile cache empty at start, fp8 cache filled: 3 MiB at start"


def test_both_e2e_sides_mux_with_the_shipped_profile_s_preset_unless_told_otherwise():
    from bench import served

    profile = str(Path(__file__).resolve().parents[1] / "docs" / "deploy" / "single-h200.toml")
    args = argparse.Namespace(x264_preset=None, deploy=profile, quick=False)
    assert served.mux_preset(args) == "veryfast", "the profile's own"
    args.x264_preset = "superfast"
    assert served.mux_preset(args) == "superfast"
    assert served.mux_preset(argparse.Namespace(x264_preset=None, deploy=None)) == "medium"


def test_e2e_serves_a_shipped_profile_as_it_ships_on_this_machines_ports(tmp_path):
    from bench import e2e, served
    from h3serve.common.config import load_deploy

    profile = Path(__file__).resolve().parents[1] / "docs" / "deploy" / "single-32gb.toml"
    shipped = load_deploy(profile)
    lora = tmp_path / "turbo.safetensors"
    lora.touch()
    args = e2e.parser().parse_args(["--deploy", str(profile), "--warm-start", "--sizes", "768x1344x124"])
    args.adapter_file = str(lora)
    config = load_deploy(served.deployment(args, "cuda", tmp_path))
    for name in ("encoder", "dit", "vae"):  # placement, memory and fast path as shipped; the weights and port not
        ours, theirs = config.service(name), shipped.service(name)
        assert ours.model_dir == "random:full" and ours.port not in (0, theirs.port)
        changed = {
            "encoder": ("cache_bytes", "int8_cache_dir"),
            "vae": ("max_raw_bytes",),
            "dit": ("adapters", "warmup", "fp8_cache_dir"),
        }[name]
        assert ours.replace(model_dir="", port=0) == theirs.replace(
            model_dir="", port=0, **{key: getattr(ours, key) for key in changed}
        )
    assert (config.encoder.cache_bytes, config.vae.max_raw_bytes) == (0, served.RAW_BYTES)
    assert (config.dit.warmup, list(config.dit.adapters)) == (("768x1344x124",), [served.ADAPTER])
    assert (config.dit.offload, config.dit.memory_limit_gib, config.encoder.cpu_offload) == ("group", 14.0, True)
    assert shipped.dit.fp8_cache_dir and not config.dit.fp8_cache_dir, "the bench's own --fp8-cache only"
    assert shipped.encoder.int8_cache_dir and not config.encoder.int8_cache_dir, "the bench's own --int8-cache only"
    assert config.gateway.data_dir == str(tmp_path / "gateway") and config.supervisor.start_timeout_s == 900
    assert served.emulated_card(config) == 31.5, "the card printed beside the services' peak"
    assert served.emulated_card(load_deploy(Path(__file__).resolve().parents[1] / "docs/deploy/tiny-cpu.toml")) == 0


def test_the_dit_forward_flop_count_matches_the_released_model_arithmetic():
    import torch
    from diffusers import MiniMaxH3Transformer3DModel

    from bench.flops import dit_forward_flops

    with torch.device("meta"):  # the released configuration, no memory
        transformer = MiniMaxH3Transformer3DModel()
    # 19.27 B block linear weights and 50 blocks of 56 x 128 attention: 1.46 + 2.07 PFLOP at 768x1344x124
    assert round(dit_forward_flops(transformer, 37_966) / 1e15, 2) == 3.53
    assert round(dit_forward_flops(transformer, 15_100) / 1e15, 2) == 0.91


@pytest.mark.processes
def test_quick_mux_bench_times_presets_against_the_default_and_measures_their_psnr(tmp_path):
    from bench import mux

    results, markdown = tmp_path / "results.json", tmp_path / "BENCHMARKS.md"
    mux.main(
        [
            "--quick",
            "--content",
            "scene",
            "--presets",
            "veryfast",
            "--write",
            "--results",
            str(results),
            "--markdown",
            str(markdown),
        ]
    )
    medium, veryfast = json.loads(results.read_text())
    assert medium["variant"].startswith("libx264 preset medium") and medium["ratio"] == 1.0
    assert veryfast["variant"].startswith("libx264 preset veryfast")
    assert veryfast["baseline_seconds"] == medium["seconds"]
    assert veryfast["ratio"] == medium["seconds"] / veryfast["seconds"]
    for record in (medium, veryfast):  # a smooth scene survives CRF 23 well; a broken decode-back would not
        assert float(re.search(r"PSNR ([\d.]+) dB", record["variant"]).group(1)) > 30


def test_mux_same_bytes_counts_the_files_of_repeated_single_threaded_encodes(capsys):
    from bench import mux

    assert mux.main(["--same-bytes", "3", "--sizes", "16x32x22", "--content", "scene"]) == []
    out = capsys.readouterr().out
    assert out.startswith("3 encodes of the same 22 frames, one x264 thread: ")
    counts = [int(n) for n in re.findall(r"'[0-9a-f]{12}': (\d+)", out)]
    assert sum(counts) == 3 and counts


class _StandInSmi:
    """A stand-in nvidia-smi on PATH: it prints the GPUs' memory.used the test sets (or exits 1 on "fail") and
    counts its calls, so the test can wait until the sampler has read what it set."""

    def __init__(self, tmp_path, monkeypatch, used: str):
        self.readings, self.calls = tmp_path / "used.csv", tmp_path / "calls"
        self.set(used)
        smi = tmp_path / "nvidia-smi"
        smi.write_text(
            f"#!/bin/sh\necho >> {self.calls}\ngrep -q fail {self.readings} && exit 1\ncat {self.readings}\n"
        )
        smi.chmod(0o755)
        monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")

    def set(self, used: str) -> None:
        staged = self.readings.with_suffix(".new")
        staged.write_text(used)
        os.replace(staged, self.readings)  # whole: the sampler never reads it half written

    def wait_until_read(self) -> None:
        """Returns once a call has begun after the last `set` (two calls: the one running at `set` may predate it)."""
        count = lambda: len(self.calls.read_text()) if self.calls.exists() else 0  # noqa: E731
        seen, deadline = count(), time.monotonic() + 60
        while count() < seen + 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert count() >= seen + 2, "the sampler stopped calling nvidia-smi"


@pytest.mark.processes
def test_gpu_peak_keeps_the_most_memory_in_use_over_what_was_in_use_at_its_start(tmp_path, monkeypatch):
    smi = _StandInSmi(tmp_path, monkeypatch, "1000\n500\n")
    with common.gpu_peak(every_s=0.01) as peak:
        for used in ("7000\n600\n", "3000\n9500\n", "1200\n500\n"):
            smi.set(used)
            smi.wait_until_read()
        assert peak.mib == [], "filled once the part ends"
    assert peak.mib == [6000, 9000]
    assert peak.at_s > 0 and peak.apps == {}, "when the fullest GPU peaked; this nvidia-smi lists no process"


@pytest.mark.processes
def test_gpu_peak_skips_a_reading_that_misses_a_gpu_or_fails(tmp_path, monkeypatch):
    # before the fix, one short reading zipped the peaks down to the GPUs it listed: [] after an empty one
    smi = _StandInSmi(tmp_path, monkeypatch, "1000\n500\n")
    with common.gpu_peak(every_s=0.01) as peak:
        for used in ("4000\n700\n", "", "9000\n", "fail", "1000\n2500\n"):
            smi.set(used)
            smi.wait_until_read()
    assert peak.mib == [3000, 2000]


def test_gpu_peak_names_each_process_by_its_service_and_the_record_adds_them_up():
    from bench.results import Record, _peak

    assert common._lineage(os.getpid())[:2] == (os.getpid(), os.getppid())
    peak = common.GpuPeak(
        processes={10: 3072, 11: 14336, 12: 12288, 13: 1024, 99: 512},
        lineage={11: (11, 20, 1), 13: (13, 20, 1)},  # two DiT ranks under their launcher, 20
    )
    peaks = peak.by_process({10: "encoder", 20: "dit", 12: "vae"})
    assert peaks == {"encoder": 3.0, "dit": 14.0, "vae": 12.0, "dit 13": 1.0}, "99 is no service's"
    record = Record("e2e", "1xH200", 1, "bfloat16", 1.0, 1.0, 1.0, 25.0, "", "", "", "", "", process_peaks_gib=peaks)
    assert _peak(record) == "25.0 (each at its most: encoder 3.0 + dit 14.0 + vae 12.0 + dit 13 1.0 = 30.0)"


@pytest.mark.processes
def test_vae_decode_writes_each_size_s_rows_before_the_next_size_runs(tmp_path):
    """A run that fails at its second size (on one H200 the compiled cuDNN attention left process-wide met the fp32
    reference) keeps the first size's rows."""
    from bench import vae_decode

    results = tmp_path / "results.json"
    argv = ["--quick", "--repeats", "1", "--sizes", "32x64x22,32x64x23", "--write", "--results", str(results)]
    with pytest.raises(SystemExit, match="17n\\+5 frames, not 23"):
        vae_decode.main([*argv, "--markdown", str(tmp_path / "BENCHMARKS.md")])
    assert [r["name"] for r in json.loads(results.read_text())] == ["vae_decode_32x64x22"]


@pytest.mark.parametrize(
    "extra", [[], ["--warm-start"], ["--side", "services"], ["--side", "in-process", "--warm-start"]]
)
def test_e2e_times_no_request_only_as_a_services_warm_start(extra, capsys):
    from bench import e2e

    with pytest.raises(SystemExit):
        e2e.main(["--quick", "--repeats", "0", *extra])
    assert "--repeats 0 times the first request after SERVING alone" in capsys.readouterr().err


def test_e2e_refuses_a_negative_count_of_timed_requests(capsys):
    from bench import e2e

    with pytest.raises(SystemExit):
        e2e.main(["--quick", "--repeats", "-1", "--warm-start", "--side", "services"])
    assert "--repeats -1: a count of timed requests, 0 or more" in capsys.readouterr().err
