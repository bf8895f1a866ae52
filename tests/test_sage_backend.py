"""`attention_backend = "sage"` refused at start, with the reason, where its kernel cannot run (this machine has no
GPU: the reasons a GPU-less host, a missing cuda-bindings, an old card or a target NVRTC lacks each give)."""

from __future__ import annotations

import sys

import pytest
import torch

from h3serve.runtime.kernels import sage
from h3serve.services.dit import attention

SHAPE = {"heads": 56, "head_dim": 128, "dtype": torch.bfloat16}


def test_without_a_gpu_sage_is_refused_with_the_reason():
    assert not torch.cuda.is_available()
    with pytest.raises(attention.BackendUnusable) as err:
        attention.check("sage", device=torch.device("cpu"), **SHAPE)
    assert str(err.value) == "attention backend 'sage' needs an NVIDIA GPU of compute capability 7.5 or newer"


def test_without_cuda_bindings_sage_is_refused_naming_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings.nvrtc", None)  # as if the package were not installed
    with pytest.raises(attention.BackendUnusable) as err:
        attention.check("sage", device=torch.device("cpu"), **SHAPE)
    assert "attention backend 'sage' needs the cuda-bindings and nvidia-cuda-nvrtc packages" in str(err.value)


def test_a_card_older_than_turing_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    with pytest.raises(attention.BackendUnusable) as err:
        attention.check("sage", device=torch.device("cuda"), **SHAPE)
    assert str(err.value) == "attention backend 'sage' needs compute capability sm_75 or newer; this GPU is sm_70"


def test_sageattention_2s_own_backends_are_refused_on_turing_and_sage_is_not():
    assert attention.capability_refusal("sage", (7, 5), torch.bfloat16) is None
    for name in ("_sage_qk_int8_pv_fp16_cuda", "_sage_qk_int8_pv_fp16_triton"):
        refusal = attention.capability_refusal(name, (7, 5), torch.bfloat16)
        assert refusal == f"attention backend {name!r} needs compute capability sm_80 or newer; this GPU is sm_75"
        assert attention.capability_refusal(name, (8, 0), torch.bfloat16) is None


@pytest.mark.parametrize(
    "capability,forced,reason",
    [
        ((7, 5), "compute_80", "target compute_80 cannot run on sm_75"),
        ((9, 0), "sm75", "H3SERVE_SAGE_TARGET='sm75' is not sm_XY or compute_XY"),
        ((12, 9), None, r"NVRTC \d+\.\d+ cannot compile for sm_129 \(it supports 75, "),
    ],
)
def test_a_target_the_card_or_nvrtc_cannot_take_is_refused_before_any_gpu_call(monkeypatch, capability, forced, reason):
    if forced:
        monkeypatch.setenv(sage.TARGET_ENV, forced)
    else:
        monkeypatch.delenv(sage.TARGET_ENV, raising=False)
    with pytest.raises(RuntimeError, match=f"attention backend 'sage': {reason}"):
        sage.check_build(capability)


def test_the_target_is_the_cards_own_cubin_unless_forced(monkeypatch):
    monkeypatch.delenv(sage.TARGET_ENV, raising=False)
    assert sage.target_for((7, 5)) == "sm_75" and sage.target_for((9, 0)) == "sm_90"
    monkeypatch.setenv(sage.TARGET_ENV, "compute_75")
    assert sage.target_for((9, 0)) == "compute_75"
