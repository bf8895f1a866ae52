"""The suite's own scheduling (tests/ordering.py): the longest modules are collected first, the rest in order; each
worker hands out ports of its own (h3serve/common/free_ports.py)."""

from __future__ import annotations

import socket
from pathlib import Path
from types import SimpleNamespace

import conftest
import ordering
import pytest

from h3serve.common import free_ports


def item(module: str, name: str):
    return SimpleNamespace(path=Path(__file__).with_name(f"{module}.py"), name=name, fixturenames=())


def test_the_longest_modules_go_first_in_their_listed_order_and_the_rest_keep_theirs():
    first, second = ordering.LONGEST_FIRST[:2]
    items = [item("test_wire", "a"), item(second, "b"), item("test_admission", "c"), item(first, "d")]
    items.append(item(second, "e"))
    conftest.pytest_collection_modifyitems(items)
    assert [i.name for i in items] == ["d", "b", "e", "a", "c"]


def test_a_name_that_is_no_test_module_stops_the_collection(monkeypatch):
    monkeypatch.setattr(ordering, "LONGEST_FIRST", (*ordering.LONGEST_FIRST, "test_renamed_away"))
    with pytest.raises(pytest.UsageError, match="names no test module: test_renamed_away"):
        conftest.pytest_collection_modifyitems([item("test_wire", "a")])


def test_each_worker_hands_out_ports_of_its_own_below_the_ephemeral_range_and_none_twice(monkeypatch):
    ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    blocks = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        monkeypatch.setattr(free_ports, "_handed_out", set())
        blocks.append(free_ports._port_block())
        ports = [free_ports.free_port() for _ in range(50)]
        assert len(set(ports)) == 50 and all(port in blocks[-1] for port in ports)
    assert not set(blocks[0]) & set(blocks[1]) and blocks[1].stop <= ephemeral
    held = next(server for port in blocks[1] if (server := _bound(port)))  # the suite's own gw1 may hold some
    with held:  # the one port not handed out yet is held: not handed out
        monkeypatch.setattr(free_ports, "_handed_out", set(blocks[1]) - {held.getsockname()[1]})
        with pytest.raises(RuntimeError, match="no free port left"):
            free_ports.free_port()


def _bound(port: int) -> socket.socket | None:
    try:
        return socket.create_server(("127.0.0.1", port))
    except OSError:
        return None
