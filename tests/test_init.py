"""`h3serve init`: the fastest shipped profile for a box (faked by a description file), written set to the box, and
accepted by `h3serve plan`."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from h3serve.cli import box as boxes
from h3serve.cli import init, profiles
from h3serve.cli.launcher import ServiceGroup
from h3serve.common.config import ConfigError, load_deploy

pytestmark = pytest.mark.processes

DEPLOY = Path(__file__).parents[1] / "docs" / "deploy"


def gpus(count: int, memory_gib: float, capability: str) -> dict:
    return {"gpus": [{"memory_gib": memory_gib, "capability": capability, "count": count}]}


# Cards as CUDA reports them: a "24 GB" Ada, a "32 GB" Blackwell, an H100 80 GB, an H200, the seeds' RTX 2080 Ti 22 GB.
BOXES = {
    "1x24GB sm_89": ({**gpus(1, 23.6, "8.9"), "host_gib": 64, "disk_gib": 200}, "single-24gb"),
    "1x32GB sm_120": ({**gpus(1, 31.8, "12.0"), "host_gib": 64, "disk_gib": 200}, "single-32gb"),
    "1x80GB sm_90": ({**gpus(1, 79.2, "9.0"), "host_gib": 125, "disk_gib": 200}, "single-h100"),
    "1x141GB sm_90": ({**gpus(1, 139.8, "9.0"), "host_gib": 250, "disk_gib": 200}, "single-h200"),
    "4x22GB sm_75": ({**gpus(4, 21.6, "7.5"), "host_gib": 192, "disk_gib": 200}, "turing-4x22"),
    "2x80GB sm_90": ({**gpus(2, 79.2, "9.0"), "host_gib": 250, "disk_gib": 200}, "single-h100"),
    "4x141GB sm_90": ({**gpus(4, 139.8, "9.0"), "host_gib": 1000, "disk_gib": 200}, "h200x4"),
}


def run_init(tmp_path: Path, box: dict, *flags: str) -> None:
    path = tmp_path / "box.json"
    path.write_text(json.dumps(box))
    parser = argparse.ArgumentParser(prog="h3serve")
    init.add_parser(parser.add_subparsers())
    args = parser.parse_args(["init", "--box", str(path), "--out", str(tmp_path / "deploy.toml"), *flags])
    args.run(args)


@pytest.mark.parametrize("box, expected", BOXES.values(), ids=BOXES)
def test_dry_run_picks_the_fastest_profile_that_fits_and_writes_nothing(tmp_path, capsys, box, expected):
    run_init(tmp_path, box, "--dry-run")
    out = capsys.readouterr().out
    chosen = [line for line in out.splitlines() if line.startswith("chosen: ")]
    assert chosen and chosen[0].startswith(f"chosen: {expected}.toml: "), out
    ahead = [p.name for p in profiles.PROFILES[: [p.name for p in profiles.PROFILES].index(expected)]]
    assert [line.split()[1] for line in out.splitlines() if line.startswith("not ")] == [f"{n}.toml:" for n in ahead]
    assert "frames" in out.split("chosen: ")[1], "what each request size costs: the ceilings"
    assert not (tmp_path / "deploy.toml").exists()
    printed = out.split("--dry-run: not written to")[1].split(":\n\n", 1)[1]
    assert tomllib.loads(printed)["supervisor"]["gpu_memory_gib"] == box["gpus"][0]["memory_gib"]


def test_it_writes_the_one_h100_layout_set_to_the_box_and_plan_accepts_it(tmp_path, capsys):
    box, _ = BOXES["1x80GB sm_90"]
    run_init(tmp_path, box, "--model-dir", "/data/MiniMax-H3")
    written = tmp_path / "deploy.toml"
    text = written.read_text()
    assert text.startswith("# Written by `h3serve init` from docs/deploy/single-h100.toml for this box:")
    data = tomllib.loads(text)
    assert data["model"]["dir"] == "/data/MiniMax-H3"
    assert data["supervisor"]["gpu_memory_gib"] == 79.2 and data["supervisor"]["host_memory_gib"] == 125
    assert data["dit"]["attention_backend"] == "cudnn_fp8" and data["encoder"]["quantize"] == "int8"
    plan = subprocess.run(
        [sys.executable, "-m", "h3serve.cli", "plan", "--config", str(written)], capture_output=True, text=True
    )
    assert plan.returncode == 0, plan.stdout + plan.stderr
    assert plan.stdout.rstrip().endswith("fits") and "768x1344: up to" in plan.stdout
    with pytest.raises(SystemExit, match="exists: --force overwrites it"):
        run_init(tmp_path, box)
    run_init(tmp_path, {**box, "host_gib": 250}, "--force")
    assert tomllib.loads(written.read_text())["supervisor"]["host_memory_gib"] == 250


def test_a_box_no_profile_fits_is_refused_with_every_reason(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        run_init(tmp_path, {**gpus(1, 79.2, "8.0"), "host_gib": 250, "disk_gib": 200}, "--dry-run")
    out = capsys.readouterr().out
    assert exit.value.code == init.REFUSED and out.rstrip().endswith("no shipped profile fits this box")
    assert "not single-h100.toml: its FP8 attention (cudnn_fp8) and fp8 weights needs sm_90 or newer" in out
    assert "not single-24gb-gguf.toml: it serves the DiT from your GGUF: give --transformer-file" in out


def test_a_box_without_a_gpu_is_refused_and_pointed_at_the_tiny_model(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        run_init(tmp_path, {"gpus": [], "host_gib": 64, "disk_gib": 200}, "--dry-run")
    out = capsys.readouterr().out
    assert exit.value.code == init.REFUSED and out.rstrip().endswith("no shipped profile fits this box")
    assert "not single-h100.toml: it places its services on 1 GPU, the box has 0" in out
    assert f"without a GPU only the tiny random model runs ({init.TINY}): `h3serve demo --config {init.TINY}`" in out
    assert Path(init.TINY).is_file() and not (tmp_path / "deploy.toml").exists()


def test_a_small_disk_turns_off_the_stores_that_only_speed_a_start_up_and_says_so(tmp_path, capsys):
    """The lent H100 has 64 GiB of disk: the DiT's fp8 store (43.8 GiB) and the encoder's int8 one (25.7) do not fit
    together, so the encoder's, which saves less, is turned off in the file; at 20 GiB both are."""
    box, _ = BOXES["1x80GB sm_90"]
    run_init(tmp_path, {**box, "disk_gib": 64}, "--dry-run")
    out = capsys.readouterr().out
    assert "\nchosen: single-h100.toml: " in out
    assert "  int8_cache_dir off: the encoder's int8 weights (25.7 GiB) do not fit the disk (64 GiB free)" in out
    written = tomllib.loads(out.split(":\n\n", 1)[1])
    assert written["encoder"]["int8_cache_dir"] == "" and written["dit"]["fp8_cache_dir"] == "var/fp8-cache"
    run_init(tmp_path, {**box, "disk_gib": 20}, "--dry-run")
    written = tomllib.loads(capsys.readouterr().out.split(":\n\n", 1)[1])
    assert written["encoder"]["int8_cache_dir"] == written["dit"]["fp8_cache_dir"] == ""


def test_a_disk_too_small_for_the_weights_a_profile_streams_from_leaves_it_out(tmp_path, capsys):
    box, _ = BOXES["1x32GB sm_120"]
    with pytest.raises(SystemExit):
        run_init(tmp_path, {**box, "disk_gib": 30}, "--dry-run")
    assert (
        "not single-32gb.toml: its quantised weights take the DiT's fp8 43.8 GiB of disk, the box has 30 GiB free"
        in capsys.readouterr().out
    )


def test_on_this_machine_the_caches_a_restart_reuses_count_as_room_for_them(tmp_path, monkeypatch):
    """`h3serve init` again on a box whose caches are filled: their files are room for the same caches (a restart
    reuses them), so a run that filled the disk does not turn its own caches off; a cache turned off still holds its
    files, which are no room for another, and one whose files are there is kept before one that would need new room.
    The files are sparse: their size is what the directory holds."""
    monkeypatch.chdir(tmp_path)  # the profiles' cache directories are relative to where the deployment runs
    for directory, gib in (("var/fp8-cache", 43.8), ("var/int8-cache", 25.7)):
        Path(directory).mkdir(parents=True)
        with open(Path(directory) / "filled.safetensors", "wb") as file:
            file.truncate(int(gib * 2**30))
    h100 = (boxes.Gpu(79.2, (9, 0)),)
    here = profiles.choose(boxes.Box(h100, 125.0, 10.0, "this machine", here=True), DEPLOY)[-1]
    assert here.profile.name == "single-h100" and here.notes == ()
    described = profiles.choose(boxes.Box(h100, 125.0, 10.0, "box.json"), DEPLOY)[-1]
    assert [note.split(":")[0] for note in described.notes] == ["fp8_cache_dir off", "int8_cache_dir off"]
    (Path("var/fp8-cache") / "filled.safetensors").unlink()  # emptied: 10 GiB free cannot hold it, the int8 is there
    emptied = profiles.choose(boxes.Box(h100, 125.0, 10.0, "this machine", here=True), DEPLOY)[-1]
    assert [note.split(":")[0] for note in emptied.notes] == ["fp8_cache_dir off"]


def test_the_box_readers():
    smi = "81559, 519, 9.0\n24564, 340, 8.9\n"
    assert boxes.parse_nvidia_smi(smi) == (boxes.Gpu(79.1, (9, 0)), boxes.Gpu(23.7, (8, 9)))
    assert boxes.parse_nvidia_smi("81559, 9.0\n") == (boxes.Gpu(79.6, (9, 0)),), "a driver without memory.reserved"
    assert [boxes.capability(v) for v in ("9.0", "sm_75", "120", [8, 9], 8.9)] == [
        (9, 0),
        (7, 5),
        (12, 0),
        (8, 9),
        (8, 9),
    ]
    with pytest.raises(boxes.BoxError, match="host_gib"):
        boxes.from_description({"gpus": []}, "box.json")
    machine = boxes.read_machine(".")
    assert machine.host_gib > 0 and machine.disk_gib > 0


def test_set_key_replaces_inserts_and_adds_a_section():
    text = "[dit]\nfp8 = true  # why\n\n[vae]\nport = 1\n"
    assert profiles.set_key(text, "dit", "fp8", "false", "n") == "[dit]\nfp8 = false  # n\n\n[vae]\nport = 1\n"
    assert (
        profiles.set_key(text, "vae", "tile_batch", "28", "n")
        == "[dit]\nfp8 = true  # why\n\n[vae]\ntile_batch = 28  # n\nport = 1\n"
    )
    assert profiles.set_key(text, "supervisor", "gpu_memory_gib", "79.2", "n").endswith(
        "\n\n[supervisor]\ngpu_memory_gib = 79.2  # n\n"
    )


def test_up_refuses_a_file_planned_for_a_larger_card_than_nvidia_smi_lists(tmp_path, monkeypatch):
    """single-h200.toml (139.8 GiB planned) started beside an H100 (a stand-in nvidia-smi on PATH lists one) is
    refused before anything starts, with the way out; a host starting only its gateway is not held to the card, nor
    is the file beside an H200's listing. On a lent H100 that file's DiT ran out of memory at load instead."""
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text('#!/bin/sh\necho "81559, 0, 9.0"\n')  # an H100 80GB HBM3 as nvidia-smi lists it
    smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{smi.parent}{os.pathsep}{os.environ['PATH']}"}
    command = [sys.executable, "-m", "h3serve.cli", "up", "--config", str(DEPLOY / "single-h200.toml")]
    done = subprocess.run([*command, "--log-dir", str(tmp_path / "logs")], capture_output=True, text=True, env=env)
    assert done.returncode == 1 and done.stderr.strip() == (
        f"h3serve up: {DEPLOY / 'single-h200.toml'}: [supervisor] gpu_memory_gib is 139.8 GiB, but this machine's "
        "largest GPU has 79.6 GiB (nvidia-smi): its plan would admit what does not fit. Write a deployment for this "
        "box with `h3serve init`, or set gpu_memory_gib to the card's size and check it with `h3serve plan`"
    )
    assert not (tmp_path / "logs").exists(), "nothing started"
    unit = subprocess.run(  # a unit per service (docs/deploy/systemd) starts it with `serve`: refused the same way
        [*command[:3], "serve", "dit", *command[4:]], capture_output=True, text=True, env=env, timeout=60
    )
    assert unit.returncode == 1 and unit.stderr.strip() == done.stderr.strip().replace("h3serve up", "h3serve serve")
    monkeypatch.setenv("PATH", env["PATH"])
    config = load_deploy(DEPLOY / "single-h200.toml")
    ServiceGroup(config, "single-h200.toml", names=("gateway",)).check_cards()  # the gateway's host: no GPU of it
    with pytest.raises(ConfigError, match="gpu_memory_gib is 139.8 GiB, but this machine's largest GPU has 79.6"):
        ServiceGroup(config, "single-h200.toml", names=("dit",)).check_cards()
    h100, h200 = boxes.Gpu(79.2, (9, 0)), boxes.Gpu(139.8, (9, 0))
    assert boxes.card_problem(139.8, (h100, h200)) is None and boxes.card_problem(79.6, (h100,)) is None
    assert boxes.card_problem(0.0, (h100,)) is None and boxes.card_problem(139.8, ()) is None
