"""The DiT's hold point for tests (h3serve/services/dit/hold.py): where it waits, what ends the wait, and its bound."""

from __future__ import annotations

import threading
import time

import pytest

from h3serve.services.dit import hold


@pytest.fixture
def point(tmp_path) -> hold.Hold:
    gate = tmp_path / "gate"
    gate.touch()
    return hold.Hold(3, gate)


def never() -> bool:
    return False


def test_unset_is_none_and_a_setting_reads_back(monkeypatch, point):
    monkeypatch.delenv(hold.ENV, raising=False)
    assert hold.from_environment() is None
    monkeypatch.setenv(hold.ENV, point.setting)
    assert hold.from_environment() == point


def test_only_its_step_waits_and_only_while_the_gate_is_there(point):
    started = time.monotonic()
    point.wait(2, never)
    point.wait(4, never)
    point.gate.unlink()
    point.wait(3, never)
    assert time.monotonic() - started < 1.0


def test_removing_the_gate_lets_it_go(point):
    threading.Timer(0.3, point.gate.unlink).start()
    started = time.monotonic()
    point.wait(3, never)
    assert 0.3 <= time.monotonic() - started < 5.0


def test_a_cancel_ends_the_wait_with_the_gate_still_there(point):
    cancelled = threading.Event()
    threading.Timer(0.3, cancelled.set).start()
    point.wait(3, cancelled.is_set)
    assert cancelled.is_set() and point.gate.exists()


def test_a_gate_left_there_holds_no_longer_than_the_limit(monkeypatch, point, caplog):
    monkeypatch.setattr(hold, "HOLD_LIMIT_S", 0.2)
    started = time.monotonic()
    point.wait(3, never)
    assert 0.2 <= time.monotonic() - started < 5.0
    assert f"{point.gate} is still there" in caplog.text
