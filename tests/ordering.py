"""The suite's tiers and order: which tests start processes (the `processes` mark), and which modules go first so
that the workers end together."""

from __future__ import annotations

from pathlib import Path

import pytest

# `make test-fast` runs the unit tier: every test but those marked `processes` (and the timing, slow and distributed
# tiers). A test that uses a fixture starting services is marked here; a module whose tests or fixtures start
# processes themselves says so (`pytestmark = pytest.mark.processes`).
PROCESS_FIXTURES = {"stack", "adapter_stack"}


# The modules that take longest (`--durations`, summed per module, on the 2-core machine), longest first. Under
# `--dist loadfile --no-loadscope-reorder` (Makefile) the workers take modules in collection order, so these start
# first and the short ones fill in after them: the workers end within seconds of each other. By default xdist orders
# modules by their test count, which put these few-test, minute-long modules last, one worker idle behind them.
LONGEST_FIRST = (
    "test_warmup",
    "test_supervision",
    "test_distributed",
    "test_multinode",
    "test_two_gateways",
    "test_fault_walk",
    "test_fastpath",
    "test_adapters",
    "test_cli",
    "test_experiment",
    "test_install_extras",
    "test_dit_group",
    "test_bench_sharded",
    "test_fuzz",
    "test_served_adapters",
    "test_bench",
    "test_media",
    "test_console",
    "test_resilience",
    "test_client",
    "test_failures",
    "test_http_door",
)


def order(items) -> None:
    """Mark the tests that start processes and put the longest modules first (pytest's collection hook)."""
    for item in items:
        if PROCESS_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.processes)
    unknown = [name for name in LONGEST_FIRST if not Path(__file__).with_name(f"{name}.py").exists()]
    if unknown:  # a renamed module would silently go back to the end
        raise pytest.UsageError(f"tests/ordering.py LONGEST_FIRST names no test module: {', '.join(unknown)}")
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.stem, len(order)))  # stable: the rest keep collection order
