"""Attention on small GPUs: the kernel choice per compute capability (faked here: this machine has no GPU),
the sage kernel's wrapper, and the DiT's refusal of fp16 with the reason."""

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from h3serve.common.config import ConfigError, load_deploy
from h3serve.runtime.kernels import sage
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


def test_sage_passes_the_capability_check_on_turing_and_is_then_checked_for_its_package(turing):
    assert attention.capability_refusal("sage", TURING, torch.bfloat16) is None
    if "sageattention" in sys.modules or _installed("sageattention"):
        pytest.skip("sageattention is installed here; the refusal below is for a machine without it")
    with pytest.raises(attention.BackendUnusable, match="needs the sageattention package installed"):
        attention.check("sage", heads=56, head_dim=128, device=GPU, dtype=torch.bfloat16)


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


def test_the_sage_wrapper_smooths_keys_out_of_place_and_computes_attention(monkeypatch):
    """The package's kernels need CUDA; a stand-in with its signature (exact attention, NHD) checks what the
    wrapper does around it: the layout, the scale, K smoothed without touching the caller's tensor."""
    calls = []

    def sageattn(q, k, v, tensor_layout, is_causal, sm_scale, smooth_k):
        calls.append((tensor_layout, is_causal, smooth_k, float(k.mean(dim=1).abs().max())))
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), scale=sm_scale)
        return out.transpose(1, 2)

    monkeypatch.setitem(sys.modules, "sageattention", types.SimpleNamespace(sageattn=sageattn))
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 64, 4, 32) for _ in range(3))
    k += 3.0  # a large common offset: smoothing removes it
    keys = k.clone()
    out = sage.attention(q, k, v)
    expected = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, keys, v))).transpose(1, 2)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(k, keys)  # the caller's keys are untouched
    layout, causal, smooth_k, key_mean = calls[0]
    assert (layout, causal, smooth_k) == ("NHD", False, False) and key_mean < 1e-5


def test_a_float16_dit_is_refused_at_start_with_the_reason(tmp_path):
    path = tmp_path / "fp16.toml"
    path.write_text('[dit]\ndtype = "float16"\n')
    with pytest.raises(ConfigError, match="65504") as err:
        load_deploy(path)
    assert "[dit] dtype" in str(err.value) and "bfloat16" in str(err.value) and "sage" in str(err.value)


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


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def test_group_offload_without_a_gpu_is_refused_at_start():
    from h3serve.common.config import DiTConfig
    from h3serve.services.dit import config_check

    with pytest.raises(ValueError, match='offload = "group" streams the blocks from host memory to a GPU'):
        config_check.check(DiTConfig(offload="group"))


@pytest.mark.parametrize(
    "version,capability,refused", [("1.0.6", TURING, True), ("1.0.6", AMPERE, False), ("2.2.0", TURING, False)]
)
def test_sageattention_1_is_refused_below_tritons_oldest_target_and_a_2x_build_is_not(
    monkeypatch, version, capability, refused
):
    monkeypatch.setattr(sage, "installed_version", lambda: version)
    if not refused:
        sage.check_build(capability)
        return
    with pytest.raises(
        RuntimeError,
        match="sageattention 1.0.6 is Triton only.*on sm_75 install a SageAttention 2.x "
        "build for it \\(TORCH_CUDA_ARCH_LIST=7.5",
    ):
        sage.check_build(capability)
