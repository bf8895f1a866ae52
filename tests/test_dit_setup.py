"""DiT group set-up decided at start: layout, torchrun command, attention backend checks."""

from __future__ import annotations

import contextlib
import json

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from h3serve.common.config import DiTConfig
from h3serve.common.free_ports import free_port
from h3serve.common.processes import EXIT_REFUSED
from h3serve.common.server import start_server
from h3serve.runtime import fastpath, wire
from h3serve.runtime.tiny import build_component
from h3serve.services.dit import attention
from h3serve.services.dit.config_check import check, transformer_shape
from h3serve.services.dit.launch import decode_config, launcher_argv
from h3serve.services.dit.parallel import Layout
from h3serve.services.dit.runner import DenoiseRunner, served
from h3serve.services.dit.server import SERVICE_NAME, DiTServicer, GroupView
from h3serve.v1 import common_pb2, dit_pb2, dit_pb2_grpc

pytestmark = pytest.mark.processes

CPU = torch.device("cpu")


def test_layout_defaults_to_ulysses_over_all_ranks_and_fsdp_only_with_ranks_to_shard_over():
    assert Layout.from_config(DiTConfig(world_size=4)) == Layout(4, 4, 1, False)
    assert Layout.from_config(DiTConfig(world_size=4, ring_degree=4, fsdp=True)) == Layout(4, 1, 4, True)
    assert Layout.from_config(DiTConfig(world_size=1, fsdp=True)) == Layout(1, 1, 1, False)


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(world_size=4, ulysses_degree=2, ring_degree=2), "hybrid"),
        (dict(world_size=4, ulysses_degree=3), "must equal world_size 4"),
        (dict(world_size=3, nnodes=2), "multiple of nnodes"),
        (dict(world_size=2, nnodes=2), "rdzv_endpoint"),
    ],
)
def test_a_layout_no_restart_can_fix_fails_before_any_rank_starts(fields, message):
    with pytest.raises(ValueError, match=message):
        check(DiTConfig(**fields))


def test_more_ranks_than_visible_gpus_fail_before_any_rank_starts():
    with pytest.raises(ValueError, match="GPU"):
        check(DiTConfig(world_size=torch.cuda.device_count() + 1, device="cuda"))


def test_the_checked_head_shape_is_the_served_transformers(tiny_model_dir):
    assert transformer_shape("", "transformer") == (2, 16)
    assert transformer_shape(str(tiny_model_dir), "transformer_ref") == (2, 16)
    assert transformer_shape("random:full", "transformer") == (56, 128)


def test_one_node_runs_h3serves_launcher_and_several_nodes_torchrun():
    config = DiTConfig(world_size=2, max_restarts=5)
    single = launcher_argv(config)
    assert single[1:3] == ["-m", "h3serve.services.dit.supervisor"]
    assert json.loads(single[-1])["world_size"] == 2 and decode_config(single[-1]) == config  # JSON, not a pickle
    multi = launcher_argv(
        DiTConfig(world_size=8, nnodes=2, rdzv_endpoint="10.0.0.1:29400", rdzv_id="h3", max_restarts=5)
    )
    assert multi[1:3] == ["-m", "torch.distributed.run"] and multi[-3:-1] == ["-m", "h3serve.services.dit.rank"]
    assert {
        "--nproc-per-node=4",
        "--max-restarts=5",
        "--nnodes=2",
        "--node-rank=1",  # 10.0.0.1 is not this machine's: the other of two nodes
        "--rdzv-backend=static",
        "--rdzv-endpoint=10.0.0.1:29400",
        "--rdzv-id=h3",
    } <= set(multi)


def test_the_node_that_owns_the_rendezvous_address_is_node_0_and_others_are_named(monkeypatch):
    from h3serve.services.dit.launch import NODE_RANK_ENV, node_rank

    monkeypatch.delenv(NODE_RANK_ENV, raising=False)
    assert node_rank(DiTConfig(world_size=2, nnodes=2, rdzv_endpoint="127.0.0.1:29400")) == 0
    assert node_rank(DiTConfig(world_size=2, nnodes=2, rdzv_endpoint="198.51.100.7:29400")) == 1
    three = DiTConfig(world_size=3, nnodes=3, rdzv_endpoint="198.51.100.7:29400")
    with pytest.raises(ValueError, match=NODE_RANK_ENV):
        node_rank(three)
    monkeypatch.setenv(NODE_RANK_ENV, "2")
    assert node_rank(three) == 2
    monkeypatch.setenv(NODE_RANK_ENV, "3")
    with pytest.raises(ValueError, match="0 to nnodes - 1"):
        node_rank(three)


def test_gloo_is_given_the_interface_that_reaches_the_rendezvous_host():
    from h3serve.services.dit.launch import interface_to

    assert interface_to("127.0.0.1") == "lo"


def test_over_several_nodes_the_launcher_refuses_before_torchrun_which_would_restart_it(capsys):
    from h3serve.services.dit import launch

    with pytest.raises(SystemExit) as exited:
        launch.serve(DiTConfig(world_size=2, nnodes=2))
    assert exited.value.code == EXIT_REFUSED, "a refusal, which `up` does not restart"
    assert "h3serve serve dit: nnodes > 1 needs rdzv_endpoint" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name,reason",
    [
        ("_native_cudnn", "No viable backend"),  # cuDNN attention has no CPU kernel
        ("flash", "flash-attn"),  # package not installed
        ("flash_hub", "downloads its kernel"),  # never downloads at run time
        ("no_such_backend", "not a valid AttentionBackendName"),
    ],
)
def test_an_unusable_attention_backend_is_refused_with_the_reason(name, reason):
    with pytest.raises(attention.BackendUnusable, match=reason) as err:
        attention.check(name, heads=2, head_dim=16, device=CPU, dtype=torch.float32)
    assert repr(name) in str(err.value)


def test_a_backend_without_context_parallelism_is_refused_for_a_split_sequence():
    attention.check("_native_math", heads=2, head_dim=16, device=CPU, dtype=torch.float32)  # one rank: fine
    with pytest.raises(attention.BackendUnusable, match="cannot split the sequence across ranks") as err:
        attention.check("_native_math", heads=2, head_dim=16, device=CPU, dtype=torch.float32, sequence_parallel=True)
    assert "_native_cudnn" in str(err.value) and "native" in str(err.value)


@pytest.mark.parametrize("name", ["flash4", "cudnn_fp8"])
def test_a_local_kernel_is_refused_for_ring_attention(name):
    with pytest.raises(attention.BackendUnusable, match="runs under Ulysses but not ring attention"):
        attention.check(name, heads=2, head_dim=16, device=CPU, dtype=torch.float32, sequence_parallel=True, ring=True)


@pytest.mark.parametrize("name", ["_native_math", "flex"])
def test_a_score_matrix_materialising_backend_is_refused_on_a_gpu(name):
    with pytest.raises(attention.BackendUnusable, match="materialises the S x S score matrix"):
        attention.check(name, heads=56, head_dim=128, device=torch.device("cuda"), dtype=torch.bfloat16)


def test_a_usable_backend_passes_the_probe_and_is_set_on_every_processor():
    transformer = build_component("transformer")
    attention.check_model(transformer, "_native_math", CPU, torch.float32)
    fastpath.set_attention(transformer, "_native_math")
    backends = {m.processor._attention_backend for m in transformer.modules() if hasattr(m, "processor")}
    assert {str(b.value) for b in backends} == {"_native_math"}
    fastpath.set_attention(transformer, "native")


def test_native_on_a_gpu_may_not_use_the_math_kernel_above_the_limit():
    gpu = torch.device("cuda")  # only the decision is tested here; the GPU run is the benchmark's
    assert isinstance(attention.no_math_kernel("native", gpu, 5000, limit=4096), contextlib.AbstractContextManager)
    assert not isinstance(attention.no_math_kernel("native", gpu, 5000, limit=4096), contextlib.nullcontext)
    assert isinstance(attention.no_math_kernel("native", gpu, 4096, limit=4096), contextlib.nullcontext)
    assert isinstance(attention.no_math_kernel("_native_cudnn", gpu, 5000, limit=4096), contextlib.nullcontext)
    assert isinstance(attention.no_math_kernel("native", CPU, 5000, limit=4096), contextlib.nullcontext)


@pytest.mark.parametrize("height,width,frames", [(32, 64, 124), (64, 96, 141)])
def test_packed_length_is_the_transformers_sequence_length(height, width, frames):
    transformer = build_component("transformer")
    seen = []
    transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["token_tags"].shape[0]), with_kwargs=True)
    parts = {"transformer": transformer, **{n: build_component(n) for n in ("scheduler", "audio_scheduler")}}
    spec = dit_pb2.DenoiseSpec(
        height=height, width=width, num_frames=frames, params=common_pb2.GenerationParams(num_inference_steps=2, seed=0)
    )
    DenoiseRunner(parts, served(["t2va"])).run(
        spec, torch.zeros(1, 9, 32), torch.ones(9, dtype=torch.int64), lambda step, total: None
    )
    assert seen == [attention.packed_length(9, spec, {})]


def test_while_the_group_starts_health_is_not_serving_and_a_request_is_unavailable_with_the_reason():
    view = GroupView(state="restarting (restart 1 of 3)")
    view.info.workflows.append(common_pb2.WORKFLOW_T2VA)
    address = f"127.0.0.1:{free_port()}"
    server, _ = start_server(
        lambda s: dit_pb2_grpc.add_DiTServicer_to_server(DiTServicer(view), s), [SERVICE_NAME], address, serving=False
    )
    try:
        with grpc.insecure_channel(address) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
            assert status.status == health_pb2.HealthCheckResponse.NOT_SERVING
            dit = dit_pb2_grpc.DiTStub(channel)
            assert dit.Info(common_pb2.InfoRequest()).state == "restarting (restart 1 of 3)"
            tensors = {"prompt_embeds": torch.zeros(1, 4, 32), "text_token_tags": torch.ones(4, dtype=torch.int64)}
            spec = dit_pb2.DenoiseSpec(
                height=32, width=64, num_frames=124, params=common_pb2.GenerationParams(num_inference_steps=3)
            )
            inputs = [
                dit_pb2.DenoiseInput(spec=spec),
                *(dit_pb2.DenoiseInput(chunk=c) for c in wire.encode_many(tensors)),
            ]
            with pytest.raises(grpc.RpcError) as err:
                list(dit.Denoise(iter(inputs), timeout=30))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert err.value.details() == "the DiT group is restarting (restart 1 of 3)"
    finally:
        server.stop(0)
