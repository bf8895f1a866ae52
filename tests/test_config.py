"""The deployment file is checked by type and range when it is read: each refusal names the file, section and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from h3serve.cli.main import main
from h3serve.common.config import DeployConfig, DiTConfig, GatewayConfig, load_deploy, override
from h3serve.model.rules import Geometry
from h3serve.services.dit.launch import decode_config, encode_config

DEPLOY_DIR = Path(__file__).parents[1] / "docs/deploy"


def refusal(tmp_path: Path, text: str) -> str:
    path = tmp_path / "deploy.toml"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        load_deploy(path)
    return str(err.value).replace(str(path), "deploy.toml")


@pytest.mark.parametrize(
    "text,message",
    [
        ('[gateway]\nport = "x"', "deploy.toml [gateway] port: Input should be a valid integer (got 'x')"),
        (
            "[gateway]\nport = 65536",
            "deploy.toml [gateway] port: Input should be less than or equal to 65535 (got 65536)",
        ),
        ("[dit]\nworld_size = 2.5", "deploy.toml [dit] world_size: Input should be a valid integer (got 2.5)"),
        ("[dit]\nnnodes = 0", "deploy.toml [dit] nnodes: Input should be greater than 0 (got 0)"),
        (
            "[gateway]\nmax_steps = -5",
            "deploy.toml [gateway] max_steps: Input should be greater than or equal to 2 (got -5)",
        ),
        ("[gateway]\nmax_steps = 10", "deploy.toml [gateway] default_steps: must be within 2..max_steps (10), got 50"),
        (
            "[gateway]\ndefault_steps = 300",
            "deploy.toml [gateway] default_steps: must be within 2..max_steps (200), got 300",
        ),
        ("[vae]\nportt = 1", "deploy.toml [vae] portt: unknown key; did you mean port?"),
        (
            "[encoder]\ntile_batch = 2",
            "deploy.toml [encoder] tile_batch: not a key of this section; it belongs in [vae]",
        ),
        ("[encoder]\nfp8 = true", "deploy.toml [encoder] fp8: not a key of this section; it belongs in [dit] or [vae]"),
        (
            "[encoder]\ncompile = true",
            "deploy.toml [encoder] compile: not a key of this section; it belongs in [dit] or [vae]",
        ),
        ('[vae]\nquantize = "int8"', "deploy.toml [vae] quantize: not a key of this section; it belongs in [encoder]"),
        (
            "[gateway]\nmax_rows = 300000",
            "deploy.toml [gateway] max_rows = 300,000 is above [dit] max_rows = 200,000: "
            "requests it admits would be refused by the dit; lower the gateway's or raise "
            "the dit's",
        ),
        (
            "[encoder]\nmax_prompt_chars = 100",
            "deploy.toml [gateway] max_prompt_chars = 8,192 is above [encoder] "
            "max_prompt_chars = 100: requests it admits would be refused by the "
            "encoder; lower the gateway's or raise the encoder's",
        ),
        (
            "[frobnicate]\nx = 1",
            "deploy.toml [frobnicate]: unknown section; known: model, encoder, dit, vae, gateway, supervisor",
        ),
        ("gateway = 5", "deploy.toml [gateway]: should be a table"),
        (
            '[encoder]\ndtype = "fp8"',
            "deploy.toml [encoder] dtype: Input should be 'float32', 'bfloat16' or 'float16' (got 'fp8')",
        ),
        (
            "[gateway.stall_s]\nstalled = 5.0",
            "deploy.toml [gateway] stall_s.stalled: Input should be 'encode', 'denoise', "
            "'decode' or 'mux' (got 'stalled')",
        ),
        (
            "[gateway.stall_s]\ndenoise = 0",
            "deploy.toml [gateway] stall_s.denoise: Input should be greater than 0 (got 0)",
        ),
        (
            '[gateway]\ntls_cert = "cert.pem"',
            "deploy.toml [gateway] tls_key: tls_cert and tls_key go together: give both or neither",
        ),
        (
            '[encoder]\ntls_key = "key.pem"',
            "deploy.toml [encoder] tls_key: tls_cert and tls_key go together: give both or neither",
        ),
        ("[gateway]\nmax_backoff_s = 0", "deploy.toml [gateway] max_backoff_s: Input should be greater than 0 (got 0)"),
        (
            "[gateway.outage_s]\nrender = 5",
            "deploy.toml [gateway] outage_s.render: Input should be 'encoder', 'vae-encode', "
            "'dit' or 'vae' (got 'render')",
        ),
        ("[gateway]\ndit = []", "deploy.toml [gateway] dit: at least one address is required"),
        (
            '[gateway.capacity.t2va]\n"768x1344" = 0',
            "deploy.toml [gateway] capacity.t2va.768x1344: Input should be greater than 0 (got 0)",
        ),
        (
            '[dit]\nworkflows = ["t2va", "i2v"]',
            "deploy.toml [dit] workflows.1: Input should be 't2va', 'fl2va' or 'ref2va' (got 'i2v')",
        ),
        ('[dit]\nfsdp = "yes"', "deploy.toml [dit] fsdp: Input should be a valid boolean (got 'yes')"),
        (
            "[model]\ncanvas_short_edge = 0",
            "deploy.toml [model] canvas_short_edge: Input should be greater than 0 (got 0)",
        ),
        (
            "[supervisor]\nmax_restarts = -1",
            "deploy.toml [supervisor] max_restarts: Input should be greater than or equal to 0 (got -1)",
        ),
        ("[supervisor]\nwindow = 60.0", "deploy.toml [supervisor] window: unknown key; did you mean window_s?"),
        (
            "[supervisor]\nbackoff_s = 5.0\nmax_backoff_s = 1.0",
            "deploy.toml [supervisor] max_backoff_s: must be at least backoff_s (5.0), got 1.0",
        ),
        (
            "[supervisor]\nstop_grace_s = 0",
            "deploy.toml [supervisor] stop_grace_s: Input should be greater than 0 (got 0)",
        ),
    ],
)
def test_a_bad_value_is_refused_naming_file_section_and_key(tmp_path, text, message):
    assert refusal(tmp_path, text + "\n") == message


def test_every_problem_of_a_section_gets_its_own_line(tmp_path):
    assert refusal(tmp_path, "[dit]\nport = -1\nheartbeat_s = 0\ncolour = 3\n").splitlines() == [
        "deploy.toml [dit] port: Input should be greater than or equal to 0 (got -1)",
        "deploy.toml [dit] heartbeat_s: Input should be greater than 0 (got 0)",
        "deploy.toml [dit] colour: unknown key",
    ]


def test_a_command_line_flag_is_checked_too():
    with pytest.raises(ValueError) as err:
        override(DeployConfig().gateway, port=-1, host=None)
    assert str(err.value) == "command line port: Input should be greater than or equal to 0 (got -1)"
    assert override(DeployConfig().dit, port=6000, world_size=None).port == 6000


def test_the_cli_exits_with_the_refusal_instead_of_a_traceback(tmp_path):
    path = tmp_path / "deploy.toml"
    path.write_text('[dit]\ndtype = "fp8"\n')
    with pytest.raises(SystemExit) as err:
        main(["capacity", "--config", str(path)])
    assert str(err.value) == (
        f"h3serve capacity: {path} [dit] dtype: Input should be 'float32', 'bfloat16' or 'float16' (got 'fp8')"
    )


@pytest.mark.parametrize("path", sorted(DEPLOY_DIR.glob("*.toml")), ids=lambda path: path.name)
def test_every_documented_deployment_loads(path):
    assert isinstance(load_deploy(path), DeployConfig)


def test_model_keys_reach_every_section_and_the_gateway_finds_the_services(tmp_path):
    path = tmp_path / "deploy.toml"
    path.write_text(
        '[model]\ndir = "/models/h3"\ncanvas_short_edge = 512\n\n[dit]\nhost = "10.0.0.2"\nport = 6000\n'
        '\n[gateway]\nvae = ["10.0.0.3:1", "10.0.0.4:1"]\n'
    )
    config = load_deploy(path)
    assert {config.service(name).geometry for name in ("encoder", "dit", "vae", "gateway")} == {
        Geometry(canvas_short_edge=512)
    }
    assert {config.service(name).model_dir for name in ("encoder", "dit", "vae", "gateway")} == {"/models/h3"}
    assert config.gateway.replicas("dit") == ("10.0.0.2:6000",)
    assert config.gateway.replicas("vae") == ("10.0.0.3:1", "10.0.0.4:1")


def test_an_outage_table_naming_one_stage_keeps_the_others_defaults(tmp_path):
    """Every stage call looks its stage's limit up: a stage left out had none, and every job failed INTERNAL."""
    path = tmp_path / "deploy.toml"
    path.write_text("[gateway.outage_s]\nvae = 2.0\n")
    assert load_deploy(path).gateway.outage_s == {"encoder": 300.0, "vae-encode": 300.0, "dit": 900.0, "vae": 2.0}


def test_a_dit_config_survives_the_rank_encoding():
    config = DiTConfig(
        port=6000,
        world_size=2,
        workflows=("ref2va",),
        geometry=Geometry(canvas_short_edge=512),
        device="cuda",
        dtype="bfloat16",
        restart_backoff_s=0.25,
    )
    decoded = decode_config(encode_config(config))
    assert decoded == config and decoded.workflows == ("ref2va",) and isinstance(decoded.geometry, Geometry)


def test_configs_are_frozen_and_replace_checks_the_change():
    config = GatewayConfig()
    with pytest.raises(ValueError):
        config.port = 1
    assert config.replace(max_steps=8, default_steps=4).default_steps == 4
    with pytest.raises(ValueError, match="default_steps"):
        config.replace(max_steps=8)
