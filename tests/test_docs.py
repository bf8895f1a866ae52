"""The docs site builds strict (a dangling link or a missing file fails it), and its generated references list every
deployment-file key of the config models and every field of the protos."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from mkdocs.commands.build import build
from mkdocs.config import load_config
from mkdocs.exceptions import Abort

from h3serve.common import config
from h3serve.v1 import common_pb2, dit_pb2, encoder_pb2, gateway_pb2, media_pb2, tensor_pb2, vae_pb2
from tools import docsgen

ROOT = Path(__file__).resolve().parents[1]


def build_site(config_file: Path, site: Path) -> None:
    build(load_config(str(config_file), strict=True, site_dir=str(site)))


def test_the_site_builds_strict(tmp_path):
    build_site(ROOT / "mkdocs.yml", tmp_path / "site")
    home = (tmp_path / "site" / "index.html").read_text()
    assert "make demo" in home and 'href="cli/"' in home, "the README is the home page, its docs/ links mapped"
    assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()
    assert (tmp_path / "site" / "BENCHMARKS" / "index.html").exists()


@pytest.mark.parametrize("link", ["missing.md", "../BENCHMARKS.md#no-such-heading", "../bench/e2e.py"])
def test_a_dangling_link_fails_the_build(tmp_path, link):
    """The same configuration and hooks on a copy holding one page with one bad link: the build stops."""
    project = tmp_path / "project"
    (project / "docs").mkdir(parents=True)
    (project / "tools").mkdir()
    for name in ("README.md", "BENCHMARKS.md"):
        shutil.copy2(ROOT / name, project / name)
    shutil.copy2(ROOT / "tools" / "mkdocs_hooks.py", project / "tools")
    (project / "docs" / "page.md").write_text(f"# A page\n\nSee [there]({link}).\n")
    (project / "README.md").write_text("# Home\n\n[the page](docs/page.md)\n")
    text = (ROOT / "mkdocs.yml").read_text()
    (project / "mkdocs.yml").write_text(text[: text.index("nav:")])  # the site's settings, every page in no nav
    with pytest.raises(Abort):
        build_site(project / "mkdocs.yml", tmp_path / "site")


def reference_tables(markdown: str) -> dict[str, list[str]]:
    """{heading: the first column of its table} of a generated reference."""
    tables: dict[str, list[str]] = {}
    heading = ""
    for line in markdown.splitlines():
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif (cell := re.match(r"\| `([^`]+)` \|", line)) and heading:
            tables.setdefault(heading, []).append(cell.group(1))
    return tables


def test_the_config_reference_lists_every_key_of_every_section():
    tables = reference_tables(docsgen.config_reference())
    models = {**config.SECTION_MODELS, "dit.adapters.<name>": config.AdapterSource}
    assert set(tables) == {f"[{name}]" for name in models}
    for name, model in models.items():
        keys = set(model.model_fields) - {"geometry"}  # set from [model]'s canvas keys, never written in a section
        assert sorted(tables[f"[{name}]"]) == sorted(keys), name
    assert set(config.SECTIONS) <= set(models), "every section of a file has its table"


def test_the_config_reference_says_type_default_and_what_is_refused():
    rows = {
        line.split("|")[1].strip(): line
        for line in docsgen.config_reference().split("## [vae]")[1].split("## [gateway]")[0].splitlines()
        if line.startswith("| `")
    }
    assert "`50053`" in rows["`port`"] and ">= 0; <= 65535" in rows["`port`"]
    assert 'it needs device = "cuda"' in rows["`decode_gpus`"]
    assert '`"veryfast"`' in rows["`x264_preset`"] and "`536870912` (512 MiB)" in rows["`max_raw_bytes`"]
    assert "libx264's threads" in rows["`x264_threads`"] and "the weights (5.75 GiB" in rows["`offload`"], (
        "each key's own comment, not its neighbour's"
    )


def test_the_api_reference_lists_every_field_with_its_comment():
    tables = reference_tables(docsgen.api_reference())
    modules = (common_pb2, dit_pb2, encoder_pb2, gateway_pb2, media_pb2, tensor_pb2, vae_pb2)
    messages = {}
    todo = [m for module in modules for m in module.DESCRIPTOR.message_types_by_name.values()]
    while todo:
        message = todo.pop()
        if not message.GetOptions().map_entry:
            messages[message.full_name.removeprefix("h3serve.v1.")] = [f.name for f in message.fields]
        todo += message.nested_types
    for name, fields in messages.items():
        assert tables.get(f"message {name}", []) == fields, name
    gateway = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"]
    assert tables["service Gateway"] == [m.name for m in gateway.methods]
    text = docsgen.api_reference()
    seed = "| `seed` | 2 | `optional uint64` | seeds the one generator the DiT draws all noise from; unset: drawn by "
    assert seed in text, "a comment that continues on the next lines stays with its field"
