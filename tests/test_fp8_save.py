"""`[dit] fp8_save`: the first start's background save of the served fp8 weights finishes before SERVING (the
default), so no request runs under it; the save is still whole and a restart assigns it. fp8 on the CPU as
tests/test_quantised_store.py runs it (torchao's hardware check lifted), through the DiT rank's own `load_whole`."""

from __future__ import annotations

import threading

import pytest
import torch
from test_fp8_store import CPU, ONE_RANK, assert_same, fp8_state, start

from h3serve.common.config import DiTConfig
from h3serve.runtime import quantised_store
from h3serve.services.dit import rank

pytestmark = pytest.mark.processes


@pytest.fixture
def held_save(monkeypatch) -> threading.Event:
    """torch.save waits for the returned event: a save in flight for as long as a test needs."""
    release, save = threading.Event(), torch.save

    def held(state, path):
        assert release.wait(120), "the save was never released"
        save(state, path)

    monkeypatch.setattr(torch, "save", held)
    yield release
    release.set()
    quantised_store.wait_for_saves(timeout_s=120)


def first_start(model_dir, cache_dir, when: str) -> torch.nn.Module:
    config = DiTConfig(
        model_dir=str(model_dir),
        dtype="bfloat16",
        fp8=True,
        fp8_cache_dir=str(cache_dir),
        fp8_save=when,
        workflows=("t2va",),
    )
    assert config.fp8_save == when
    return rank.load_whole(config, ONE_RANK, CPU, ["transformer"])[0]["transformer"]


def test_serving_waits_for_the_save_which_is_whole_and_a_restart_assigns_it(
    fp8_on_cpu, loads, held_save, tiny_model_dir, tmp_path
):
    first = first_start(tiny_model_dir, tmp_path, DiTConfig().fp8_save)
    states: list[str] = []
    announced, serving = threading.Event(), threading.Event()

    def announce(state: str) -> None:
        states.append(state)
        announced.set()

    def hold() -> None:
        quantised_store.before_serving(DiTConfig().fp8_save, announce)
        serving.set()

    holder = threading.Thread(target=hold)
    holder.start()
    assert announced.wait(60)
    assert not serving.is_set(), "SERVING before the save (held until released) was written"
    assert states == ["writing the fp8 weights before SERVING ([dit] fp8_save)"]
    held_save.set()
    assert serving.wait(120)
    holder.join()
    (saved,) = tmp_path.glob("transformer-fp8-*")
    assert not list(tmp_path.glob("*.partial-*")) and ".partial-" not in saved.name
    blocks = len(first.transformer_blocks)
    assert sorted(f.name for f in saved.iterdir()) == sorted(
        ["rest.pt", *(f"transformer_blocks.{i}.pt" for i in range(blocks))]
    ), "whole: a file per block and one for the rest"
    restarted = start(tiny_model_dir, tmp_path)
    assert loads[-1] == ["scheduler", "audio_scheduler"], "the restart neither loads nor quantises the transformer"
    assert_same(fp8_state(restarted), fp8_state(first))


def test_background_serves_at_once_while_the_save_goes_on(fp8_on_cpu, loads, held_save, tiny_model_dir, tmp_path):
    first_start(tiny_model_dir, tmp_path, "background")
    states: list[str] = []
    quantised_store.before_serving("background", states.append)  # returns with the save still held
    assert states == [] and not quantised_store.wait_for_saves(timeout_s=0)
    held_save.set()
    assert quantised_store.wait_for_saves(timeout_s=120)
    assert len(list(tmp_path.glob("transformer-fp8-*"))) == 1


def test_nothing_to_write_is_no_wait():
    states: list[str] = []
    quantised_store.before_serving("before_serving", states.append)
    assert states == []
