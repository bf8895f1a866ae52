"""Attention on small GPUs: the kernel choice per compute capability (faked here: this machine has no GPU) and the
DiT's refusal of fp16 with the reason (the sage kernel itself: tests/test_sage_*.py)."""

import pytest
import torch

from h3serve.common.config import ConfigError, load_deploy
from h3serve.services.dit import attention

GPU = torch.device("cuda")
TURING, AMPERE, HOPPER = (7, 5), (8, 0), (9, 0)


@pytest.fixture
def turing(monkeypatch):
    """The DiT's start-up check sees an RTX 2080 Ti (sm_75); nothing reaches a real GPU before the refusal."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: TURING)


@pytest.mark.parametrize("name", ["native", "_native_cudnn", "_native_flash", "_native_efficient"])
def test_bf16_sdpa_is_refused_on_turing_with_the_reason_and_what_to_use(turing, name):
    with pytest.raises(attention.BackendUnusable) as err:
        attention.check(name, heads=56, head_dim=128, device=GPU, dtype=torch.bfloat16)
    message = str(err.value)
    assert repr(name) in message and "sm_75" in message and "MATH" in message
    assert 'attention_backend = "sage"' in message


@pytest.mark.parametrize(
    "name,needed", [("flash4", "sm_90"), ("cudnn_fp8", "sm_90"), ("flash", "sm_80"), ("_flash_3", "sm_90")]
)
def test_a_kernel_newer_than_the_gpu_is_refused_naming_both_capabilities(turing, name, needed):
    with pytest.raises(
        attention.BackendUnusable, match=f"needs compute capability {needed} or newer; this GPU is sm_75"
    ):
        attention.check(name, heads=56, head_dim=128, device=GPU, dtype=torch.bfloat16)


def test_the_kernels_each_generation_has_for_bf16():
    assert attention.kernels_for(TURING, torch.bfloat16) == ["sage"]
    assert set(attention.kernels_for(AMPERE, torch.bfloat16)) == {
        "_native_cudnn",
        "_native_flash",
        "_native_efficient",
        "sage",
        "flash",
    }
    assert set(attention.kernels_for(HOPPER, torch.bfloat16)) == {
        "_native_cudnn",
        "_native_flash",
        "_native_efficient",
        "sage",
        "flash",
        "flash4",
        "cudnn_fp8",
        "_flash_3",
    }


def test_float32_sdpa_is_not_refused_for_capability():
    # mem-efficient SDPA takes fp32 on any CUDA GPU: only bf16 lacks a Turing kernel
    assert attention.capability_refusal("_native_efficient", TURING, torch.float32) is None


def test_a_float16_dit_is_refused_at_start_with_the_reason(tmp_path):
    path = tmp_path / "fp16.toml"
    path.write_text('[dit]\ndtype = "float16"\n')
    with pytest.raises(ConfigError, match="65504") as err:
        load_deploy(path)
    assert "[dit] dtype" in str(err.value) and "bfloat16" in str(err.value) and "fp16_scaled" in str(err.value)


@pytest.mark.parametrize(
    "section,table,reason",
    [
        ("dit", "fsdp_offload = true", "needs fsdp = true"),
        ("dit", 'world_size = 2\noffload = "group"', '"group" offload runs one rank'),
        ("encoder", "spread = true\ncpu_offload = true", "choose one"),
        ("encoder", 'quantize = "int4"', "quantize"),
        ("vae", "memory_limit_gib = -1", "memory_limit_gib"),
    ],
)
def test_every_small_gpu_option_refuses_a_bad_value_naming_the_key(tmp_path, section, table, reason):
    path = tmp_path / "bad.toml"
    path.write_text(f"[{section}]\n{table}\n")
    with pytest.raises(ConfigError, match=reason) as err:
        load_deploy(path)
    assert f"[{section}]" in str(err.value)


def test_group_offload_without_a_gpu_is_refused_at_start():
    from h3serve.common.config import DiTConfig
    from h3serve.services.dit import config_check

    with pytest.raises(ValueError, match='offload = "group" streams the blocks from host memory to a GPU'):
        config_check.check(DiTConfig(offload="group"))
