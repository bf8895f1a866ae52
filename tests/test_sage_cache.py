"""The NVRTC binary cache (h3serve/runtime/kernels/nvrtc_cache.py): real NVRTC compiles, files on a real disk."""

from __future__ import annotations

import pytest

from h3serve.runtime.kernels import nvrtc_cache

SOURCE = b'extern "C" __global__ void mark(int* x) { *x = 75; }\n'


def load(tmp_path, source=SOURCE, target="sm_75", version=None):
    return nvrtc_cache.load("mark", source, target, tmp_path, version)


def test_a_second_load_reads_the_cached_binary_instead_of_compiling(tmp_path):
    first = load(tmp_path)
    assert first.compile_s is not None and "compiled now by NVRTC" in first.origin()
    again = load(tmp_path)
    assert again.compile_s is None and again.image == first.image and again.path == first.path
    assert again.origin() == f"read from the cache {first.path}"
    assert first.path.read_bytes()[nvrtc_cache.DIGEST :] == first.image  # the file: checksum, then the binary


@pytest.mark.parametrize(
    "change", [{"source": SOURCE + b"// edited\n"}, {"target": "sm_90"}, {"version": "99.9"}], ids=str
)
def test_the_source_the_target_and_nvrtcs_version_each_key_the_file(tmp_path, change):
    original = load(tmp_path)
    changed = load(tmp_path, **change)
    assert changed.path != original.path and changed.compile_s is not None
    assert load(tmp_path).compile_s is None  # the original stays cached beside it


def test_ptx_is_cached_nul_terminated_for_the_driver(tmp_path):
    ptx = load(tmp_path, target="compute_75")
    assert ptx.path.suffix == ".ptx" and b".target sm_75" in ptx.image and ptx.image.endswith(b"\0")


@pytest.mark.parametrize("damage", ["flipped", "truncated", "empty"])
def test_a_damaged_file_is_set_aside_and_the_binary_compiled_again(tmp_path, damage, caplog):
    good = load(tmp_path)
    data = good.path.read_bytes()
    damaged = {
        "flipped": data[:-1] + bytes([data[-1] ^ 1]),
        "truncated": data[: len(data) // 2],
        "empty": b"",
    }[damage]
    good.path.write_bytes(damaged)
    rebuilt = load(tmp_path)
    assert rebuilt.compile_s is not None and rebuilt.image == good.image
    aside = list(tmp_path.glob(f"{good.path.name}.damaged-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == damaged
    assert "is damaged" in caplog.text
    assert load(tmp_path).compile_s is None  # the rebuilt file is whole


def test_the_directory_is_the_users_cache_unless_overridden(monkeypatch, tmp_path):
    monkeypatch.delenv(nvrtc_cache.DIRECTORY_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert nvrtc_cache.default_directory() == tmp_path / "xdg" / "h3serve" / "kernels"
    monkeypatch.setenv(nvrtc_cache.DIRECTORY_ENV, str(tmp_path / "mine"))
    assert nvrtc_cache.default_directory() == tmp_path / "mine"


def test_a_source_nvrtc_rejects_fails_with_its_log(tmp_path):
    with pytest.raises(RuntimeError, match="NVRTC could not compile mark for sm_75: .*undefined"):
        load(tmp_path, source=b'extern "C" __global__ void mark() { undefined_name = 1; }\n')
    assert not list(tmp_path.iterdir())  # nothing cached
