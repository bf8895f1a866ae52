"""Each DiT rank loads only its FSDP2 shards (h3serve/runtime/sharded_load.py), on 2 CPU ranks (gloo).

The rank-side checks run in one torchrun launch of this file (fresh interpreters, not forks of the fork server:
forked.run_ranks says why):

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/test_sharded_load.py OUT TINY_DIR BIG_DIR
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from h3serve.runtime.sharded_load import RandomWeights
from h3serve.runtime.tiny import build_component

pytestmark = pytest.mark.processes

TOLERANCE = 1e-5  # fp32: the split changes only the order of floating-point sums
MARGIN = 48 << 20  # host bytes a rank may hold during a load besides its shards and one block
# a transformer large enough that its weights stand out of the interpreter's noise (~280 MB fp32), still fast
BIG_TRANSFORMER = dict(
    num_attention_heads=8,
    attention_head_dim=64,
    hidden_size=512,
    num_layers=16,
    num_refiner_layers=1,
    ffn_dim=2048,
    in_channels=24,
    audio_in_channels=32,
    text_dim=32,
    freq_dim=16,
    time_embed_hidden_dim=32,
    time_embed_dim=16,
    rope_freq_dim=2,
)


@pytest.fixture(scope="module")
def report(tmp_path_factory, tiny_model_dir) -> dict:
    from diffusers import MiniMaxH3Transformer3DModel

    root = tmp_path_factory.mktemp("sharded-load")
    MiniMaxH3Transformer3DModel(**BIG_TRANSFORMER).save_pretrained(str(root / "big" / "transformer"))
    out = root / "checks.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            __file__,
            str(out),
            str(tiny_model_dir),
            str(root / "big"),
        ],
        check=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return json.loads(out.read_text())


@pytest.mark.distributed
def test_shards_loaded_from_the_meta_device_give_the_whole_load_latents(report):
    assert report["latents"].keys() == {"fsdp", "fsdp_offload"}
    for name, diff in report["latents"].items():
        assert diff <= TOLERANCE, f"{name}: max abs difference {diff}"
    assert report["buffers_match"], "rope frequencies computed at construction, as the whole load has them"


@pytest.mark.distributed
def test_offloaded_shards_live_in_host_memory(report):
    assert report["offload"] == {"policy": "CPUOffloadPolicy", "shards_on_cpu": True}


@pytest.mark.distributed
def test_a_rank_holds_its_shard_and_at_most_one_block_more_while_loading(report):
    for rank in report["host"]:
        bound = rank["shard_bytes"] + rank["block_bytes"] + MARGIN
        assert rank["whole_bytes"] > bound, "the bound must be one the whole model breaks"
        assert rank["shard_bytes"] * 2 >= rank["whole_bytes"], "each rank holds half (its rows)"
        assert rank["peak_bytes"] <= bound, f"host peak {rank['peak_bytes']} B over {bound} B"


@pytest.mark.distributed
def test_random_shards_are_the_same_on_every_start_and_finite(report):
    assert report["random"] == {"same_twice": True, "finite": True, "ranks_differ": True}


def test_group_offload_is_refused_on_a_cpu_rank_with_the_reason():
    from h3serve.services.dit import parallel

    with pytest.raises(ValueError, match='offload = "none"'):
        parallel.offload_groups(build_component("transformer"), torch.device("cpu"))


# ---- rank side (run by torchrun) ----


class TinyRandom(RandomWeights):
    """random:full's per-rank values on the tiny preset's modules (the released sizes do not fit a CI machine)."""

    def factory(self) -> torch.nn.Module:
        return build_component(self.component)


def host_rss() -> dict[str, int]:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {key: int(status[key].split()[0]) * 1024 for key in ("VmRSS", "VmHWM")}


def host_peak(big_dir: str) -> dict[str, int]:
    """This rank's host memory peak while loading its shards of the big transformer, above what it held before."""
    from torch.distributed.fsdp import FSDPModule

    from h3serve.runtime import sharded_load
    from h3serve.runtime.fastpath import FastPath
    from h3serve.runtime.models import ModelSource
    from h3serve.services.dit import parallel

    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark restarts from the current size
    before = host_rss()["VmRSS"]
    model = parallel.load_sharded(
        ModelSource(big_dir).weights("transformer"),
        parallel.Layout(2, 2, 1, True),
        FastPath("native"),
        torch.device("cpu"),
        torch.float32,
    )
    peak = host_rss()["VmHWM"]
    blocks = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    return {
        "peak_bytes": peak - before,
        "shard_bytes": sharded_load.shard_bytes(model),
        "block_bytes": max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in blocks),
        "whole_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }


def main(out_path: str, tiny_dir: str, big_dir: str) -> None:
    import torch.distributed as dist
    from dist_checks import JOB_SPEC, T2VA, inputs, max_diff, run
    from torch.distributed.fsdp import CPUOffloadPolicy

    from h3serve.runtime.fastpath import FastPath
    from h3serve.runtime.models import ModelSource
    from h3serve.services.dit import parallel
    from h3serve.services.dit.group import JOB, ControlPlane, GroupMember, Message
    from h3serve.services.dit.runner import SCHEDULERS, DenoiseRunner

    control = ControlPlane(parallel.init_groups(torch.device("cpu"), timeout_s=120))
    host = control.gather(host_peak(big_dir))  # first: nothing loaded before it raises the process's heap

    source = ModelSource(tiny_dir)
    whole = source.load(["transformer", *SCHEDULERS], "cpu", "float32")
    reference = DenoiseRunner(whole, [T2VA]).run(JOB_SPEC, *inputs(11).values(), lambda s, t: None)
    message = Message(JOB, JOB_SPEC, inputs(11)) if control.rank == 0 else None

    def sharded(weights, offload: bool = False) -> tuple[torch.nn.Module, GroupMember]:
        transformer = parallel.load_sharded(
            weights, parallel.Layout(2, 2, 1, True, offload), FastPath("native"), torch.device("cpu"), torch.float32
        )
        parts = {"transformer": transformer, **source.load(SCHEDULERS, "cpu", "float32")}
        return transformer, GroupMember(control, DenoiseRunner(parts, [T2VA]), torch.device("cpu"), "native", 4096)

    report = {"host": host, "latents": {}}
    for name, offload in (("fsdp", False), ("fsdp_offload", True)):
        transformer, member = sharded(source.weights("transformer"), offload)
        report["latents"][name] = max_diff(run(member, message).latents, reference)
    transformer.reshard()  # FSDP2 leaves the root's own parameters gathered after a forward
    policy = transformer.transformer_blocks[0]._get_fsdp_state()._fsdp_param_group.offload_policy
    report["offload"] = {
        "policy": type(policy).__name__ if isinstance(policy, CPUOffloadPolicy) else "none",
        "shards_on_cpu": all(p.to_local().device.type == "cpu" for p in transformer.parameters()),
    }
    report["buffers_match"] = torch.equal(transformer.rope.inv_freq, whole["transformer"].rope.inv_freq)

    first, member = sharded(TinyRandom("transformer"))
    again, _ = sharded(TinyRandom("transformer"))
    latents = run(member, message).latents["latents"]
    first.reshard()
    values = torch.cat([p.to_local().flatten() for p in first.parameters()])
    report["random"] = {
        "same_twice": all(
            torch.equal(a.to_local(), b.to_local()) for a, b in zip(first.parameters(), again.parameters(), strict=True)
        ),
        "finite": bool(latents.isfinite().all() and latents.std() > 0),
        "ranks_differ": len({tuple(rank[:64].tolist()) for rank in control.gather(values)}) == 2,
    }
    if control.rank == 0:
        Path(out_path).write_text(json.dumps(report, indent=1))
    dist.barrier()  # without it gloo teardown sometimes aborts
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
