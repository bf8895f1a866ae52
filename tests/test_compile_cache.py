"""`compile_cache.set_aside_if_damaged`: which start failures move the compile cache aside (the whole restart is
tests/test_warmup.py::test_a_torn_compile_cache_is_set_aside_and_the_restart_compiles_afresh)."""

from __future__ import annotations

import errno

import pytest

from h3serve.runtime import compile_cache


@pytest.fixture
def cache(tmp_path, monkeypatch):
    directory = tmp_path / "compile-cache"
    monkeypatch.setattr(compile_cache, "_in_use", "")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")
    monkeypatch.setenv("TRITON_CACHE_DIR", "")
    compile_cache.use(str(directory))
    return directory


def raised(exc: BaseException, cause: BaseException | None = None) -> BaseException:
    """`exc` as raised (with its traceback), from `cause`."""
    try:
        raise exc from cause
    except BaseException as caught:  # noqa: BLE001 - returned to the test
        return caught


def test_a_failure_reading_a_cache_file_moves_the_cache_aside(cache):
    torn = raised(RuntimeError(f"Failed to import {cache}/inductor/kf/ckfs3.py"), SyntaxError("unterminated string"))
    said = compile_cache.set_aside_if_damaged(torn)
    (aside,) = cache.parent.glob("compile-cache.damaged-*")
    assert said == f"the compile cache {cache} could not be read: moved to {aside}, the next start compiles afresh"
    assert (aside / "inductor").is_dir() and not cache.exists()
    assert (
        compile_cache.set_aside_if_damaged(torn)
        == f"the compile cache {cache} could not be read (set aside by another rank)"
    )


@pytest.mark.parametrize(
    "failure",
    [
        lambda cache: raised(RuntimeError("out of memory")),  # names no cache file
        lambda cache: raised(RuntimeError(f"Failed to import {cache}-other/x.py")),  # a sibling with the same prefix
        lambda cache: raised(  # a full disk names the cache, but the cache is whole
            RuntimeError(f"could not write {cache}/inductor/a.py"), OSError(errno.ENOSPC, "No space left on device")
        ),
    ],
)
def test_other_failures_leave_the_cache_where_it_is(cache, failure):
    assert compile_cache.set_aside_if_damaged(failure(cache)) == ""
    assert (cache / "inductor").is_dir() and not list(cache.parent.glob("*.damaged-*"))
