"""The suite's own scheduling (tests/conftest.py): the longest modules are collected first, the rest in order."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import conftest
import pytest


def item(module: str, name: str):
    return SimpleNamespace(path=Path(__file__).with_name(f"{module}.py"), name=name, fixturenames=())


def test_the_longest_modules_go_first_in_their_listed_order_and_the_rest_keep_theirs():
    first, second = conftest.LONGEST_FIRST[:2]
    items = [item("test_wire", "a"), item(second, "b"), item("test_admission", "c"), item(first, "d")]
    items.append(item(second, "e"))
    conftest.pytest_collection_modifyitems(items)
    assert [i.name for i in items] == ["d", "b", "e", "a", "c"]


def test_a_name_that_is_no_test_module_stops_the_collection(monkeypatch):
    monkeypatch.setattr(conftest, "LONGEST_FIRST", (*conftest.LONGEST_FIRST, "test_renamed_away"))
    with pytest.raises(pytest.UsageError, match="names no test module: test_renamed_away"):
        conftest.pytest_collection_modifyitems([item("test_wire", "a")])
