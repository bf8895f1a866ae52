"""LoRA adapters in one process: the DiT's runner with its adapters installed as a rank installs them (alpha,
switching, transformer_ref, compiled slots, fusing, fp8's filter), the refusals at start, and the request rules the
gateway and the DiT share (h3serve/model/adapters.py). The served path through the real stack:
tests/test_served_adapters.py; on 2 ranks with FSDP2: tests/test_distributed.py."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
from deployments import write_config
from forked import run_forked
from lora_files import diffusers_lora, factors, manual_merge, original_lora

from h3serve.common.config import ConfigError, DiTConfig, load_deploy
from h3serve.gateway.admission.request import RequestLimits, resolve
from h3serve.model import workflows
from h3serve.model.adapters import AdapterCatalog, AdapterFacts, Recommendation
from h3serve.model.rules import InvalidRequest
from h3serve.runtime import fastpath
from h3serve.runtime.fastpath import FastPath
from h3serve.runtime.tiny import build_component
from h3serve.services.dit import adapters, checks, config_check, warmup
from h3serve.services.dit.runner import DenoiseRunner
from h3serve.v1 import common_pb2, dit_pb2, gateway_pb2, media_pb2

pytestmark = pytest.mark.processes

T2VA, REF2VA = (workflows.by_value(w) for w in (common_pb2.WORKFLOW_T2VA, common_pb2.WORKFLOW_REF2VA))
TOLERANCE = 1e-5  # relative, fp32: an unfused LoRA and a merged weight differ in the order of the sums only
RANK, ALPHA = 4, 2.0  # alpha != rank: every module runs at 0.5 x its weight


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("loras")
    return {
        "kohya": original_lora(root / "kohya.safetensors", 1, RANK, ALPHA, fused=False),
        "aitk": original_lora(root / "aitk.safetensors", 1, RANK, ALPHA, style="aitk", fused=False),
        "qkv": original_lora(root / "qkv.safetensors", 2, RANK, ALPHA, sidecar={"steps": 3, "flow_shift": 6.0}),
        "diffusers": diffusers_lora(root / "diffusers", 3, RANK, 2 * RANK),
        "ref": diffusers_lora(root / "ref", 4, 2, 1.0, partition="transformer_ref"),
    }


def components() -> dict:
    from diffusers.schedulers import MiniMaxH3Scheduler

    return {
        "transformer": build_component("transformer"),
        "transformer_ref": build_component("transformer_ref"),
        "scheduler": MiniMaxH3Scheduler(shift=12.0),
        "audio_scheduler": MiniMaxH3Scheduler(shift=3.0),
    }


def runner(files: dict, names=(), flows=(T2VA, REF2VA), fast: FastPath | None = None, **config) -> DenoiseRunner:
    """A DiT rank's runner: its adapters installed, then the fast path, as rank.py does."""
    parts = components()
    loaded = {flow.partition: parts[flow.partition] for flow in flows}
    dit = DiTConfig(
        adapters={name: str(files[name]) for name in names},
        workflows=tuple(f.name for f in flows),
        compile=bool(fast and fast.compile),
        **config,
    )
    held = adapters.install(dit, loaded)
    for model in loaded.values():
        if fast is not None:
            fastpath.apply(model, fast)
    return DenoiseRunner(parts, list(flows), held)


def spec(*named, workflow=T2VA, steps: int = 3, **params) -> dit_pb2.DenoiseSpec:
    job = dit_pb2.DenoiseSpec(
        height=32,
        width=64,
        num_frames=124,
        workflow=workflow.value,
        params=common_pb2.GenerationParams(num_inference_steps=steps, seed=5, **params),
    )
    for name, weight in named:
        job.params.adapters.add(name=name, weight=weight)
    if workflow is REF2VA:
        job.references.add(kind=media_pb2.ASSET_KIND_IMAGE)
    return job


def run(denoiser: DenoiseRunner, job: dit_pb2.DenoiseSpec) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    embeds, tags = torch.randn(1, 10, 32, generator=generator), torch.ones(10, dtype=torch.int64)
    conditioning = None
    if job.workflow == REF2VA.value:
        latents = {"condition_latents.0": torch.randn(1, 24, 1, 2, 4, generator=generator)}
        conditioning = REF2VA.denoise_inputs(job, latents)
    out = denoiser.run(job, embeds, tags, lambda step, total: None, conditioning)
    return torch.cat([out["latents"].flatten(), out["audio_latents"].flatten()])


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to fp32 rounding, relative to the latents' size (the tiny random model's reach 10)."""
    return bool((a - b).abs().max() <= TOLERANCE * b.abs().max().clamp(min=1.0))


def merged_runner(path, scale: float) -> DenoiseRunner:
    parts = components()
    manual_merge(parts["transformer"], path, scale)
    return DenoiseRunner(parts, [T2VA])


@pytest.mark.parametrize("fmt", ["kohya", "aitk", "diffusers"])
def test_alpha_over_rank_is_applied_as_a_manual_merge_gives_it(files, fmt):
    """kohya's per-module .alpha (folded by diffusers), ai-toolkit's __metadata__ alpha, diffusers' own lora_alpha."""
    alpha = 2 * RANK if fmt == "diffusers" else ALPHA
    served = run(runner(files, [fmt]), spec((fmt, 0.5)))
    assert close(served, run(merged_runner(files[fmt], alpha / RANK * 0.5), spec()))
    unscaled = run(merged_runner(files[fmt], 0.5), spec())  # the seeds' bug: alpha dropped, every module at 1 x w
    assert (served - unscaled).abs().max() > 1e-2
    (facts,) = adapters.read_all(
        DiTConfig(adapters={fmt: str(files[fmt])}),
        {"transformer": config_check.transformer_skeleton("", "transformer")},
    )
    assert (facts.facts.rank, facts.facts.alpha, facts.facts.partitions) == (RANK, alpha, ("transformer",))
    assert set(factors(files[fmt])) <= {
        k.removeprefix("transformer.").removesuffix(".lora_A.weight")
        for k in facts.state_dict
        if k.endswith("lora_A.weight")
    }


def test_switching_adapters_gives_what_a_fresh_runner_with_that_adapter_gives(files):
    served = runner(files, ["kohya", "diffusers", "qkv"])
    requests = [
        [("kohya", 1.0)],
        [("diffusers", 0.0)],
        [("kohya", 1.0)],
        [],
        [("qkv", 0.7), ("diffusers", 1.0)],
        [("kohya", -0.5)],
    ]
    outputs = [run(served, spec(*named)) for named in requests]
    for named, output in zip(requests, outputs, strict=True):
        fresh = runner(files, sorted({name for name, _ in named}))
        assert torch.equal(output, run(fresh, spec(*named))), named
    assert torch.equal(outputs[3], run(DenoiseRunner(components(), [T2VA, REF2VA]), spec())), "no adapter: the base"
    assert not torch.equal(outputs[0], outputs[1])


def test_a_transformer_ref_file_adapts_ref2va_only(files, tmp_path):
    served = runner(files, ["ref", "kohya"])
    assert [(f.name, f.partitions) for f in served.adapters.facts] == [
        ("kohya", ("transformer",)),
        ("ref", ("transformer_ref",)),
    ]
    base = run(DenoiseRunner(components(), [T2VA, REF2VA]), spec(workflow=REF2VA))
    adapted = run(served, spec(("ref", 1.0), workflow=REF2VA))
    assert not torch.equal(adapted, base)
    assert torch.equal(run(served, spec(workflow=REF2VA)), base)
    # diffusers' load_into_transformer_ref: a transformer. (or original) file routed into the ref2va partition
    into_ref = DiTConfig(adapters={"k": {"path": str(files["kohya"]), "transformer_ref": True}})
    (routed,) = adapters.read_all(into_ref, {p: config_check.transformer_skeleton("", p) for p in adapters.PREFIXES})
    assert routed.facts.partitions == ("transformer_ref",)
    # a DiT serving ref2va only routes a transformer. file there by itself, as diffusers does
    (alone,) = adapters.read_all(
        DiTConfig(adapters={"k": str(files["kohya"])}),
        {"transformer_ref": config_check.transformer_skeleton("", "transformer_ref")},
    )
    assert alone.facts.partitions == ("transformer_ref",)


def test_compiled_slots_switch_adapters_without_recompiling(files):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    eager = runner(files, ["kohya", "qkv"], flows=(T2VA,))
    compiled = runner(files, ["kohya", "qkv"], flows=(T2VA,), fast=FastPath(compile=True), adapter_slots=2)
    assert compiled.adapters.describe()["max_request_adapters"] == 2
    requests = [[("kohya", 1.0)], [("qkv", 1.0)], [("qkv", 0.5), ("kohya", 2.0)], [], [("kohya", -1.0)], [("qkv", 1.0)]]
    run(compiled, spec(*requests[0]))  # compiles (the block's graphs for both forwards of a request)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    for named in requests:
        assert close(run(compiled, spec(*named)), run(eager, spec(*named))), named
    assert counters["stats"]["unique_graphs"] == graphs, "switching adapters recompiled the blocks"

    # why the slots: peft's own switch (set_adapters, a Python float scale) recompiles for every adapter and weight
    resident = runner(files, ["kohya", "qkv"], flows=(T2VA,))
    fastpath.apply(resident.pipes[T2VA.value].transformer, FastPath(compile=True))
    run(resident, spec(*requests[0]))
    graphs = counters["stats"]["unique_graphs"]
    run(resident, spec(("kohya", 0.5)))
    assert counters["stats"]["unique_graphs"] > graphs


def test_a_compiled_dit_warms_up_with_its_first_adapter_already_in_a_slot(files):
    """The warm-up names the first adapter loaded (in name order) that adapts t2va's partition, so its factors are in
    slot 0 before SERVING and the first request naming it copies nothing in from host memory; resident adapters have
    nothing to copy, so their warm-up names none."""
    names = ["ref", "qkv"]  # loaded in name order; "ref" adapts transformer_ref only
    compiled = runner(files, names, fast=FastPath(compile=True), adapter_slots=2)
    config = DiTConfig(adapters={n: str(files[n]) for n in names}, compile=True, adapter_slots=2)
    message = warmup.warm_message(SimpleNamespace(runner=compiled), config, "32x64x124", 10)
    assert [(a.name, a.weight) for a in message.spec.params.adapters] == [("qkv", 1.0)]
    compiled.adapters.apply(T2VA.partition, message.spec.params.adapters)  # what the warm-up's run does first
    assert compiled.adapters.holder.holding[T2VA.partition] == ["qkv", None]
    assert runner(files, names).adapters.warm(T2VA.partition) == []


def test_slots_hold_each_adapters_factors_as_peft_loaded_them_in_its_dtype(files):
    # float32 files on bf16 weights: peft loads the factors as bf16, and the slots' host copies are those values at
    # that size (the file's float32 would be twice the host memory of a released adapter's factors)
    transformer = build_component("transformer").to(torch.bfloat16)
    config = DiTConfig(adapters={"kohya": str(files["kohya"])}, compile=True)
    holder = adapters.install(config, {"transformer": transformer}).holder
    held = holder.factors["transformer"]["kohya"]
    assert held and {(f.down.dtype, f.up.dtype) for f in held.values()} == {(torch.bfloat16, torch.bfloat16)}
    read = adapters.read("kohya", config.adapters["kohya"], ["transformer"]).part("transformer")
    for module, f in held.items():
        assert torch.equal(f.down, read[f"transformer.{module}.lora_A.weight"].to(torch.bfloat16))
        assert torch.equal(f.up, read[f"transformer.{module}.lora_B.weight"].to(torch.bfloat16))


def test_fused_mode_merges_the_one_adapter_and_every_request_runs_it(files):
    fused = runner(files, ["qkv"], adapter_mode="fused")
    (facts,) = fused.adapters.facts
    assert facts.fused and fused.adapters.mode == "fused"
    assert not any("lora" in name for name, _ in fused.pipes[T2VA.value].transformer.named_modules())
    unfused = run(runner(files, ["qkv"]), spec(("qkv", 1.0)))
    assert close(run(fused, spec()), unfused)
    assert close(run(fused, spec(("qkv", 1.0))), unfused)


def test_fp8_quantises_the_adapted_layers_but_not_the_lora_factors(files):
    model = runner(files, ["qkv"], flows=(T2VA,)).pipes[T2VA.value].transformer
    targets = {name for name, module in model.named_modules() if fastpath.fp8_target(module, name)}
    assert "transformer_blocks.0.attn.to_q.base_layer" in targets
    assert "transformer_blocks.0.attn.to_out.0.base_layer" in targets
    assert not [name for name in targets if ".lora_" in name]


def test_the_schedules_shift_per_request_and_return_to_the_model_s_own(files):
    served = runner(files, [])
    base = run(served, spec())
    shifted = run(served, spec(flow_shift=6.0, audio_flow_shift=2.0))
    assert not torch.equal(base, shifted)
    assert torch.equal(run(served, spec()), base)
    assert torch.equal(run(served, spec(flow_shift=12.0, audio_flow_shift=3.0)), base)


# Refused at start: by the deployment file's check, and by rank 0 before it loads anything (config_check.py).


def _bad_file(path, key: str, shape=(RANK, 32)):
    from safetensors.torch import save_file

    other = key.replace("lora_A", "lora_B")
    save_file({key: torch.zeros(shape), other: torch.zeros(32, RANK)}, str(path))
    return path


@pytest.mark.parametrize(
    "key,problem",
    [
        ("transformer.transformer_blocks.0.attn.to_nowhere.lora_A.weight", "the partition has no linear layer"),
        ("transformer.transformer_blocks.0.attn.to_q.lora_A.weight", "shape (4, 48)"),
    ],
)
def test_a_file_that_does_not_fit_the_transformer_stops_the_dit_at_start_naming_the_key(
    tmp_path, files, fork_server, key, problem
):
    bad = _bad_file(tmp_path / "bad.safetensors", key, (RANK, 48) if "to_q" in key else (RANK, 32))
    config = DiTConfig(adapters={"good": str(files["kohya"]), "bad": str(bad)})
    with pytest.raises(adapters.AdapterRefused) as err:
        config_check.check(config)
    assert f"adapters.bad: {bad}: key {key!r} does not fit transformer: {problem}" in str(err.value)

    # `h3serve serve dit` exits with that reason, not restarting its group (what `up` and the logs show)
    deploy = write_config(
        tmp_path / "deploy.toml",
        "",
        tmp_path / "gw",
        dict(encoder=1, dit=2, vae=3, gateway=4),
        dit={"adapters": {"bad": str(bad)}},
    )
    done = run_forked(  # a fork of the session's fork server, as `h3serve up` starts it: its imports done
        fork_server, [sys.executable, "-m", "h3serve.cli", "serve", "dit", "--config", str(deploy)], 120, check=False
    )
    assert done.returncode == 78  # processes.EXIT_REFUSED: `h3serve up` does not restart it either
    assert f"h3serve serve dit: adapters.bad: {bad}: key {key!r} does not fit transformer" in done.stderr
    assert "configuration was refused" in done.stderr and "(restart 1 of" not in done.stderr


def test_an_adapter_for_a_partition_the_dit_does_not_load_is_refused_at_start(files):
    config = DiTConfig(adapters={"ref": str(files["ref"])}, workflows=("t2va",))
    with pytest.raises(
        adapters.AdapterRefused, match="adapters.ref: it loads into transformer_ref, which this DiT does not load"
    ):
        config_check.check(config)


@pytest.mark.parametrize(
    "dit,problem",
    [
        ({"adapters": {"turbo4": "/nowhere/turbo4.safetensors"}}, "adapters.turbo4: no such file: /nowhere/turbo4"),
        ({"adapters": {"turbo4": "{json}"}}, "adapters.turbo4: sidecar {json_sidecar}: unknown key 'shift'"),
        ({"adapters": {"t": "{pt}"}}, "adapters.t: must be a .safetensors file"),
        ({"adapters": {"bad name": "{lora}"}}, "adapters.bad name: an adapter name is"),
        (
            {"adapters": {"a": "{lora}", "b": "{lora}"}, "adapter_mode": "fused"},
            'adapter_mode: "fused" merges exactly one adapter into the weights; adapters has 2',
        ),
    ],
)
def test_the_deployment_file_refuses_bad_adapters_naming_the_key(tmp_path, files, dit, problem):
    (tmp_path / "sided.safetensors").write_bytes(files["kohya"].read_bytes())
    (tmp_path / "sided.json").write_text('{"steps": 5, "shift": 6}')
    (tmp_path / "t.pt").write_bytes(b"")
    paths = {
        "{json}": str(tmp_path / "sided.safetensors"),
        "{pt}": str(tmp_path / "t.pt"),
        "{lora}": str(files["kohya"]),
    }
    dit = {**dit, "adapters": {k: paths.get(v, v) for k, v in dit["adapters"].items()}}
    deploy = write_config(
        tmp_path / "deploy.toml", "", tmp_path / "gw", dict(encoder=1, dit=2, vae=3, gateway=4), dit=dit
    )
    with pytest.raises(ConfigError) as err:
        load_deploy(deploy)
    assert f"{deploy} [dit] {problem.replace('{json_sidecar}', str(tmp_path / 'sided.json'))}" in str(err.value)


# The request rules, shared by the gateway (resolve) and the DiT's boundary (checks.py).

CATALOG = AdapterCatalog(
    {
        "turbo4": AdapterFacts("turbo4", ("transformer",), 128, 8.0, Recommendation(5, 6.0, None)),
        "style": AdapterFacts("style", ("transformer",), 64, 0.0, Recommendation(0, 5.0, 2.0)),
        "ref": AdapterFacts("ref", ("transformer_ref",), 16, 16.0),
    }
)


def _resolve(*named, catalog=CATALOG, **fields) -> common_pb2.GenerationParams:
    request = gateway_pb2.GenerateRequest(prompt="a fox", **fields)
    for name, weight in named:
        request.params.adapters.add(name=name, weight=weight)
    return resolve(request, RequestLimits(default_steps=50), catalog=catalog).params


def test_the_gateway_fills_weights_steps_and_shifts_from_the_first_recommending_adapter():
    params = _resolve(("turbo4", 0.0), ("style", 0.5))
    assert [(a.name, a.weight) for a in params.adapters] == [("turbo4", 1.0), ("style", 0.5)]
    assert (params.num_inference_steps, params.flow_shift, params.audio_flow_shift) == (5, 6.0, 2.0)
    params = _resolve(("style", 1.0), params=common_pb2.GenerationParams(num_inference_steps=9, flow_shift=7.5))
    assert (params.num_inference_steps, params.flow_shift, params.audio_flow_shift) == (9, 7.5, 2.0)
    params = _resolve()
    assert (list(params.adapters), params.num_inference_steps, params.flow_shift, params.audio_flow_shift) == (
        [],
        50,
        12.0,
        3.0,
    )


def test_a_fused_dit_s_adapter_is_part_of_every_resolved_request():
    fused = AdapterCatalog(
        {"turbo4": AdapterFacts("turbo4", ("transformer",), recommended=Recommendation(5), fused=True)}
    )
    params = _resolve(catalog=fused)
    assert ([(a.name, a.weight) for a in params.adapters], params.num_inference_steps) == ([("turbo4", 1.0)], 5)
    for named in ([("turbo4", 0.5)], [("other", 1.0)]):
        with pytest.raises(InvalidRequest, match="adapters: "):
            _resolve(*named, catalog=AdapterCatalog({**fused.adapters, "other": CATALOG.adapters["style"]}))


@pytest.mark.parametrize(
    "named,fields,message",
    [
        ([("nope", 1.0)], {}, "adapters: unknown adapter 'nope'; this DiT loads ref, style, turbo4"),
        ([("x" * 65, 1.0)], {}, "adapters: a name is 1-64 characters"),
        ([("turbo4", 10.5)], {}, "adapters: turbo4: weight must be within -10..10 (0 means 1.0), got 10.5"),
        ([("turbo4", float("nan"))], {}, "adapters: turbo4: weight must be within"),
        ([("turbo4", 1.0), ("turbo4", 0.5)], {}, "adapters: turbo4 is named twice"),
        ([("ref", 1.0)], {}, "adapters: ref targets transformer_ref, not transformer, the partition t2va runs on"),
        ([], {"flow_shift": 0.0}, "flow_shift: must be a number with 0 < shift <= 100, got 0.0"),
        ([], {"audio_flow_shift": 100.5}, "audio_flow_shift: must be a number with 0 < shift <= 100"),
        ([], {"flow_shift": float("inf")}, "flow_shift: must be a number"),
    ],
)
def test_every_bad_adapter_or_shift_is_refused_naming_its_field(named, fields, message):
    with pytest.raises(InvalidRequest) as err:
        _resolve(*named, params=common_pb2.GenerationParams(**fields))
    assert str(err.value).startswith(message)


def test_a_compiled_dit_takes_at_most_its_slots():
    with pytest.raises(InvalidRequest, match="adapters: at most 1 per request on this DiT"):
        _resolve(("turbo4", 1.0), ("style", 1.0), catalog=AdapterCatalog(CATALOG.adapters, max_per_request=1))


def test_the_dit_refuses_an_unknown_adapter_at_its_boundary():
    check = checks.DenoiseCheck(DiTConfig(), [T2VA.value], lambda workflow: checks.ModelDims(32, 24, 32), CATALOG)
    with pytest.raises(InvalidRequest, match="adapters: unknown adapter 'nope'; this DiT loads ref, style, turbo4"):
        check.expect(spec(("nope", 1.0)))
    with pytest.raises(InvalidRequest, match="flow_shift: must be a number"):
        check.expect(spec(flow_shift=-1.0))
    check.expect(spec(("turbo4", 1.0)))
