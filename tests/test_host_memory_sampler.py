"""bench/common.py's host-memory sampler: /proc parsing, the process-tree walk, and the peaks of real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import common

pytestmark = pytest.mark.processes

STATUS = """Name:\tpython
Pid:\t4242
VmRSS:\t  350000 kB
RssAnon:\t  200000 kB
RssFile:\t  100000 kB
RssShmem:\t   50000 kB
Threads:\t3
"""
MEMINFO = "MemTotal:       16000000 kB\nMemFree:         1000000 kB\nMemAvailable:    12000000 kB\nCached: 9 kB\n"


def test_status_and_meminfo_parse_to_kib_and_a_torn_read_to_none():
    memory = common.parse_status(STATUS)
    assert memory == common.ProcMemory(anon_kib=200000, file_kib=100000, shmem_kib=50000)
    assert memory.private_kib == 250000, "anon + shmem: what the kernel cannot drop"
    assert common.parse_status(STATUS.split("RssShmem")[0]) is None, "cut short before its last Rss line"
    assert common.parse_status("Name:\tkthreadd\nPid:\t2\n") is None, "a kernel thread has no Rss lines"
    assert common.parse_meminfo(MEMINFO) == 4000000
    assert common.parse_meminfo("MemTotal:       16000000 kB\nMemFr") is None


class _FakeProc:
    """A /proc tree in a directory: per pid, its status and each thread's children file."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.meminfo(used_kib=1 << 20)

    def process(
        self,
        pid: int,
        anon_kib: int,
        file_kib: int = 0,
        shmem_kib: int = 0,
        children: dict[int, list[int]] | None = None,
    ) -> None:
        """`children` by thread id (default: the main thread, none)."""
        status = f"Pid:\t{pid}\nRssAnon:\t{anon_kib} kB\nRssFile:\t{file_kib} kB\nRssShmem:\t{shmem_kib} kB\n"
        self._write(self.root / str(pid) / "status", status)
        for task, pids in (children or {pid: []}).items():
            self._write(self.root / str(pid) / "task" / str(task) / "children", " ".join(map(str, pids)))

    def meminfo(self, used_kib: int) -> None:
        self._write(self.root / "meminfo", f"MemTotal: {8 << 20} kB\nMemAvailable: {(8 << 20) - used_kib} kB\n")

    @staticmethod
    def _write(path: Path, text: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        staged = path.with_suffix(".new")
        staged.write_text(text)
        os.replace(staged, path)  # whole: the sampler never reads it half written


def test_the_tree_walk_sums_every_descendant_and_skips_a_vanished_or_torn_process(tmp_path):
    proc = _FakeProc(tmp_path)
    # 10 (a service) -> 11 from its main thread, 12 and 99 from another thread; 11 -> 13; 99 is listed but gone
    proc.process(10, anon_kib=1000, file_kib=5000, children={10: [11], 17: [12, 99]})
    proc.process(11, anon_kib=200, shmem_kib=300, children={11: [13]})
    proc.process(12, anon_kib=40, file_kib=60)
    proc.process(13, anon_kib=7)
    proc.process(20, anon_kib=1 << 30)  # not in the tree
    (tmp_path / "14").mkdir()
    (tmp_path / "14" / "status").write_text("Pid:\t14\nRssAnon:\t5")  # torn: counted as nothing
    (tmp_path / "13" / "task" / "13" / "children").write_text("14")
    assert common.process_tree([10], str(tmp_path)) == {10, 11, 12, 13, 14, 99}
    assert common.tree_memory([10], str(tmp_path)) == common.ProcMemory(1247, 5060, 300)
    assert common.tree_memory([10, 11, 99], str(tmp_path)) == common.ProcMemory(1247, 5060, 300), "counted once"
    assert common.tree_memory([], str(tmp_path)) == common.ProcMemory(0, 0, 0)


def _wait_for_samples(peak: common.HostPeak, count: int = 2) -> None:
    """Returns once `count` samples began after the call (the one running at the call may have read before)."""
    seen, deadline = peak.samples, time.monotonic() + 60
    while peak.samples < seen + count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert peak.samples >= seen + count, "the sampler stopped sampling"


def test_host_peak_keeps_each_peak_of_the_roots_asked_at_every_sample(tmp_path):
    proc, roots = _FakeProc(tmp_path), []
    proc.process(10, anon_kib=1 << 20, file_kib=3 << 20)
    proc.process(11, anon_kib=2 << 20, shmem_kib=1 << 20)
    with common.host_peak(lambda: list(roots), every_s=0.01, proc=str(tmp_path)) as peak:
        _wait_for_samples(peak)
        assert (peak.private_gib, peak.file_gib, peak.used_gib) == (0, 0, 0), "no roots yet"
        roots.append(10)  # a service started after the sampler
        _wait_for_samples(peak)
        roots.append(11)
        proc.process(10, anon_kib=1 << 20, file_kib=1 << 20)  # its files dropped from the page cache
        proc.meminfo(used_kib=6 << 20)
        _wait_for_samples(peak)
        proc.meminfo(used_kib=2 << 20)
        roots.clear()
        _wait_for_samples(peak)
    assert (peak.private_gib, peak.file_gib, peak.used_gib) == (4, 3, 5)


def _mount_type(path: Path) -> str:
    """The filesystem type of the mount that holds `path` (the longest mount point above it)."""
    mounts = [line.split()[1:3] for line in Path("/proc/self/mounts").read_text().splitlines()]
    return max(
        ((point, kind) for point, kind in mounts if str(path.resolve()).startswith(point)),
        key=lambda mount: len(mount[0]),
    )[1]


# Each child makes its memory resident, says "ready" and holds it until its stdin closes.
ANON = "b = bytearray(200 << 20); b[::4096] = b'x' * len(range(0, len(b), 4096))"  # every page written
MAPPED = (
    "import mmap, sys; f = open(sys.argv[1], 'rb'); b = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ); "
    "sum(b[i] for i in range(0, len(b), 4096))"
)  # every page read: file pages, no anonymous copy
HOLD = "; print('ready', flush=True); sys.stdin.read()"


def test_host_peak_of_real_processes_counts_anonymous_memory_as_private_and_a_mapped_file_apart(tmp_path):
    data = tmp_path / "weights.bin"
    data.write_bytes(os.urandom(100 << 20))
    if _mount_type(data) in ("tmpfs", "ramfs"):
        pytest.skip("a file on tmpfs maps as shared memory (RssShmem), not as file pages")
    children: list[subprocess.Popen] = []
    with common.host_peak(lambda: [child.pid for child in children], every_s=0.05) as peak:
        try:
            for code in (ANON, MAPPED):
                children.append(
                    subprocess.Popen(
                        [sys.executable, "-c", f"import sys; {code}{HOLD}", str(data)],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                )
                assert children[-1].stdout.readline() == "ready\n"
            _wait_for_samples(peak)  # one has read both children holding their memory
        finally:
            for child in children:
                child.stdin.close()
                child.wait()
    private_mib, file_mib = peak.private_gib * 1024, peak.file_gib * 1024
    # two interpreters add some tens of MiB of their own (heap, libraries mapped from disk)
    assert 200 <= private_mib < 200 + 80, "the bytearray, without the mapped file"
    assert 100 <= file_mib < 100 + 80, "the mapped file, without the bytearray"
