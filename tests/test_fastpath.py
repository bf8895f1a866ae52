"""The fast-path options refuse what cannot run here, at start and with the reason."""

from __future__ import annotations

import importlib.util

import pytest

from h3serve.common.config import ModelServiceConfig
from h3serve.runtime import fastpath
from h3serve.runtime.fastpath import FastPath
from h3serve.runtime.tiny import build_component


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn-4 is installed here")
def test_flash4_without_its_package_fails_with_the_reason():
    with pytest.raises(RuntimeError, match="attention backend 'flash4' needs the flash-attn-4 package"):
        fastpath.apply(build_component("transformer"), FastPath(attention="flash4"))


def test_an_unknown_attention_backend_is_refused_by_name():
    with pytest.raises(ValueError, match="backend='no-such-kernel'"):
        fastpath.apply(build_component("vae"), FastPath(attention="no-such-kernel"))


def test_fp8_needs_bf16_weights():
    with pytest.raises(ValueError, match='fp8 needs dtype = "bfloat16"'):
        FastPath.of(ModelServiceConfig(fp8=True))
    assert FastPath.of(ModelServiceConfig(dtype="bfloat16", fp8=True, compile=True)).describe() == "native+compile+fp8"


def test_the_default_fast_path_is_diffusers_native_eager():
    assert FastPath.of(ModelServiceConfig()) == FastPath(attention="native", compile=False, fp8=False)


@pytest.mark.skipif(importlib.util.find_spec("cudnn") is not None, reason="nvidia-cudnn-frontend is installed here")
def test_fp8_attention_without_the_cudnn_frontend_fails_with_the_reason():
    with pytest.raises(RuntimeError, match="attention backend 'cudnn_fp8' needs the nvidia-cudnn-frontend package"):
        fastpath.apply(build_component("transformer"), FastPath(attention="cudnn_fp8"))


def test_fast_paths_name_their_options_and_which_change_the_numbers():
    fast = FastPath(attention="cudnn_fp8", compile=True)
    assert fast.describe() == "cudnn_fp8+compile" and fast.lossy
    assert FastPath(fp8=True).lossy and not FastPath(attention="flash4", compile=True).lossy
