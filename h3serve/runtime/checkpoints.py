"""The DiT's `transformer` from one file users already have (`[dit] transformer_file`): the published single-file
layout (`.safetensors`, the ComfyUI repackaging) or a GGUF of it (`.gguf`, dequantised per layer as it runs).

diffusers reads both: `MiniMaxH3Transformer3DModel.from_single_file` converts the layout
(`convert_minimax_h3_transformer_checkpoint_to_diffusers`, `qkv_layout="stacked"`, the order of every published
file), and `GGUFQuantizationConfig` keeps GGUF weights quantised. The model's config always comes from the model
directory's `transformer/config.json`, so nothing is fetched (the benchmarks' `random:full` source has no directory:
its config is the released one, the class's defaults, written once per process).

`check` reads only the file's header (names, shapes, GGUF types) and runs diffusers' own converter on meta tensors,
so a file that cannot load is refused at start, in one line naming it, before any weight reaches a GPU.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import logging
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from h3serve.common.config import FILE_FORMATS as FORMATS
from h3serve.common.config import FILE_PARTITION, GGUF
from h3serve.common.disk import readable_size
from h3serve.model import presets

if TYPE_CHECKING:
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3Transformer3DModel

log = logging.getLogger("h3serve.runtime.checkpoints")
PARTITION = FILE_PARTITION  # the published files are the t2va / fl2va transformer; transformer_ref stays as released
DETECTION_KEY = "token_refiner.blocks.0.attn.qkv_proj.weight"  # diffusers' CHECKPOINT_KEY_NAMES["minimax-h3"]
QKV_LAYOUT = "stacked"
FINGERPRINT_BYTES = 1 << 20  # the header (names, shapes, offsets) and the first weights
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth")


class CheckpointRefused(ValueError):
    """A transformer_file that cannot be served; the message names the file and the reason, on one line. Every door
    that loads one (`serve dit`, `h3serve reference`) prints it as it is, never a traceback."""

    def __init__(self, path: str | Path, reason: str) -> None:
        super().__init__(f"transformer_file {str(path)!r}: {' '.join(str(reason).split())}")


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == GGUF


def fingerprint(path: str | Path) -> str:
    """Changes when the file does (size, modification time, the first MiB): part of the model revision, so the caches
    keyed by it never mix the weights of two files."""
    path = Path(path)
    if not path.is_file():
        return f"{path}:absent"
    stat = path.stat()
    with path.open("rb") as f:
        head = hashlib.sha256(f.read(FINGERPRINT_BYTES)).hexdigest()[:16]
    return f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{head}"


def config_folder(model_dir: str) -> Path:
    """The folder of the transformer's config.json."""
    if model_dir == presets.RANDOM_FULL:
        return _released_config()
    return Path(model_dir) / PARTITION


@functools.cache
def _released_config() -> Path:
    from diffusers import MiniMaxH3Transformer3DModel as Transformer

    root = tempfile.mkdtemp(prefix="h3serve-config-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    folder = Path(root) / PARTITION
    with torch.device("meta"):
        Transformer().save_config(str(folder))
    return folder


def skeleton(model_dir: str) -> torch.nn.Module:
    """The transformer of the model directory's config on the meta device (no memory)."""
    from diffusers import MiniMaxH3Transformer3DModel as Transformer

    with torch.device("meta"):
        return Transformer.from_config(Transformer.load_config(str(config_folder(model_dir))))


def header(path: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """(tensor name -> logical shape, GGUF tensor name -> its type name), read without the weights. A truncated or
    malformed file raises here: both readers check the header against the file's length."""
    if is_gguf(path):
        from gguf import GGUFReader

        tensors = GGUFReader(path).tensors
        return (
            {t.name: tuple(int(n) for n in reversed(t.shape.tolist())) for t in tensors},  # ggml lists dims
            {t.name: t.tensor_type.name for t in tensors},
        )  # innermost first
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}, {}


def check(path: str | Path, model_dir: str) -> None:
    """CheckpointRefused unless `path` loads into the model directory's transformer: it exists, is .safetensors or
    .gguf, is whole, has the published layout (or diffusers' own), is not pruned, its tensors have the transformer's
    shapes, and its GGUF types are ones diffusers dequantises."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointRefused(path, "no such file")
    if path.suffix.lower() not in FORMATS:
        raise CheckpointRefused(path, f"unknown format {path.suffix!r}: a transformer file is {' or '.join(FORMATS)}")
    try:
        shapes, types = header(path)
    except Exception as exc:  # the readers' own words: "incomplete metadata, file not fully covered", ...
        raise CheckpointRefused(path, f"unreadable (truncated or not a {path.suffix} file): {exc}") from None
    _check_types(path, types)
    expected = {name: tuple(t.shape) for name, t in skeleton(model_dir).state_dict().items()}
    found = _converted_shapes(path, shapes, model_dir, expected)
    missing = _missing(sorted(expected.keys() - found.keys()), shapes, found, model_dir)
    unexpected = sorted(found.keys() - expected.keys())
    wrong = _wrong_shapes(shapes, found, expected, model_dir)
    for problems, what in (
        (missing, "lacks"),
        (unexpected, "has tensors the transformer does not:"),
        (wrong, "has wrong shapes:"),
    ):
        if problems:
            more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
            raise CheckpointRefused(
                path, f"does not fit {config_folder(model_dir)}/config.json: it {what} {', '.join(problems[:3])}{more}"
            )


def _wrong_shapes(
    shapes: dict[str, tuple[int, ...]],
    found: dict[str, tuple[int, ...]],
    expected: dict[str, tuple[int, ...]],
    model_dir: str,
) -> list[str]:
    """Each tensor of the file whose shape does not fit, by the file's own name and shape (what its owner can find
    in it), with the transformer's tensor it becomes and the shape that one must have."""
    wrong: dict[str, list[str]] = {}
    for name, shape in expected.items():
        if name in found and found[name] != shape:
            sources = _sources(name, shapes, model_dir) if name not in shapes else [name]
            for source in sources or [name]:
                wrong.setdefault(source, []).append(f"{name} must be {list(shape)}")
    return [
        f"{source} {list(shapes.get(source, found.get(source, ())))} (it becomes {', '.join(becomes)})"
        for source, becomes in wrong.items()
    ]


def _missing(
    missing: list[str], shapes: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], model_dir: str
) -> list[str]:
    """The file's names of what it lacks, where another block shows them: a tensor missing from block 1 is named as
    the file names its twin in a block that has it (`blocks.1.mlp.fc2.weight`); diffusers' name where none does."""
    named: list[str] = []
    for name in missing:
        block = _block(name)
        twins = (_in_block(name, other) for other in sorted({_block(key) for key in found} - {block, ""}))
        twin = next((twin for twin in twins if twin in found), None) if block else None
        sources = [_in_block(source, block) for source in _sources(twin, shapes, model_dir)] if twin else []
        named += [source for source in sources if source not in shapes] or [name]
    return list(dict.fromkeys(named))


def _in_block(name: str, block: str) -> str:
    """`name` with its first number (its block's) replaced by `block`."""
    parts = name.split(".")
    first = next(i for i, part in enumerate(parts) if part.isdigit())
    return ".".join([*parts[:first], block, *parts[first + 1 :]])


def _sources(converted: str, shapes: dict[str, tuple[int, ...]], model_dir: str) -> list[str]:
    """The file's tensors diffusers' converter makes tensor `converted` from: among those of the same block number
    and kind (weight, bias...), those whose shape, changed, changes its shape (the converter renames, splits the
    stacked qkv and reorders; its mapping is not public)."""
    kind, block = converted.rsplit(".", 1)[-1], _block(converted)
    base = _convert_meta(shapes, model_dir).get(converted)
    sources = []
    for name, shape in shapes.items():
        if not shape or name.rsplit(".", 1)[-1] != kind or _block(name) != block:
            continue
        try:
            changed = _convert_meta({**shapes, name: (shape[0] * 3, *shape[1:])}, model_dir).get(converted)
        except (ValueError, RuntimeError):
            continue
        if changed != base:
            sources.append(name)
    return sources


def _block(name: str) -> str:
    """A tensor name's first number (its block's), "" for none."""
    return next((part for part in name.split(".") if part.isdigit()), "")


def _convert_meta(shapes: dict[str, tuple[int, ...]], model_dir: str) -> dict[str, tuple[int, ...]]:
    """diffusers' converter on meta tensors of `shapes`: the names and shapes it makes."""
    from diffusers import MiniMaxH3Transformer3DModel as Transformer
    from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers as convert

    meta = {name: torch.empty(shape, device="meta") for name, shape in shapes.items()}
    converted = convert(meta, config=Transformer.load_config(str(config_folder(model_dir))), qkv_layout=QKV_LAYOUT)
    return {name: tuple(tensor.shape) for name, tensor in converted.items()}


def _check_types(path: Path, types: dict[str, str]) -> None:
    if not types:
        return
    from diffusers.quantizers.gguf.utils import SUPPORTED_GGUF_QUANT_TYPES

    supported = {t.name for t in SUPPORTED_GGUF_QUANT_TYPES} | {"F32", "F16"}
    unsupported = sorted({kind for kind in types.values() if kind not in supported})
    if unsupported:
        raise CheckpointRefused(
            path,
            f"GGUF type(s) {', '.join(unsupported)} are not among those diffusers "
            f"dequantises ({', '.join(sorted(supported))})",
        )


def _converted_shapes(
    path: Path, shapes: dict[str, tuple[int, ...]], model_dir: str, expected: dict[str, tuple[int, ...]]
) -> dict[str, tuple[int, ...]]:
    """The file's tensors as diffusers' converter names and shapes them (run on meta tensors: its refusals, the
    pruned checkpoint's among them, are its own words). A file already in diffusers' names is loaded as it is."""
    if shapes.keys() == expected.keys():
        return shapes
    if DETECTION_KEY not in shapes and "adaln_t_table" not in shapes:
        raise CheckpointRefused(
            path,
            f"unknown layout: neither MiniMax-H3's published single-file layout (it has no "
            f"{DETECTION_KEY}) nor diffusers' own",
        )
    try:
        return _convert_meta(shapes, model_dir)
    except (ValueError, RuntimeError) as exc:
        raise CheckpointRefused(path, str(exc)) from None


def load(path: str | Path, model_dir: str, dtype: torch.dtype) -> torch.nn.Module:
    """The transformer from `path` in `dtype` on the CPU (the caller places it): diffusers' `from_single_file`, a GGUF
    kept quantised with `dtype` as its compute dtype. Call `check` first: its refusals are the clear ones."""
    from diffusers import GGUFQuantizationConfig
    from diffusers import MiniMaxH3Transformer3DModel as Transformer

    log.info("loading the transformer from %s", describe_weight_file(Path(path)))
    if is_gguf(path):  # the quantiser keeps `_keep_in_fp32_modules` in float32 itself
        return Transformer.from_single_file(
            str(path),
            config=str(config_folder(model_dir).parent),
            subfolder=PARTITION,
            torch_dtype=dtype,
            local_files_only=True,
            qkv_layout=QKV_LAYOUT,
            quantization_config=GGUFQuantizationConfig(compute_dtype=dtype),
        )
    state = converted(path, model_dir)
    model = Transformer.from_single_file(
        state,
        config=str(config_folder(model_dir).parent),
        subfolder=PARTITION,
        torch_dtype=dtype,
        local_files_only=True,
    )
    keep_fp32_modules(model, state)
    return model


def describe_weight_file(path: Path) -> str:
    """ "PATH (N.N GiB, format)": what the start log says of each weight file it loads."""
    return f"{path.resolve()} ({readable_size(path.stat().st_size)}, {path.suffix.lstrip('.') or 'no suffix'})"


def weight_files(folder: Path) -> list[Path]:
    """A released component folder's weight files (its shards), in name order."""
    return sorted(path for path in folder.iterdir() if path.suffix in WEIGHT_SUFFIXES) if folder.is_dir() else []


def converted(path: str | Path, model_dir: str) -> dict[str, torch.Tensor]:
    """The safetensors file's tensors (memory-mapped) in diffusers' names, by diffusers' converter."""
    from diffusers import MiniMaxH3Transformer3DModel as Transformer
    from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers as convert
    from safetensors.torch import load_file

    state = load_file(str(path))
    if DETECTION_KEY not in state:  # already diffusers' names (check() refused every other layout)
        return state
    return convert(state, config=Transformer.load_config(str(config_folder(model_dir))), qkv_layout=QKV_LAYOUT)


def keep_fp32_modules(model: MiniMaxH3Transformer3DModel, state: dict[str, torch.Tensor]) -> None:
    """`_keep_in_fp32_modules` back in float32, from the file's values: from_single_file casts every module to its
    torch_dtype (its fp32 list applies to float16 and quantisers only), where from_pretrained, the released layout's
    load, keeps them in float32; so both layouts serve the same numbers."""
    keep = model._keep_in_fp32_modules or []
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and tensor.dtype != torch.float32 and any(m in name.split(".") for m in keep):
            module_name, _, attr = name.rpartition(".")
            module = model.get_submodule(module_name)
            value = state[name].to(torch.float32)
            if attr in module._parameters:
                module._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)
            else:
                module._buffers[attr] = value
    # its one non-persistent buffer (not in any file): rebuilt in float32 from the config, as at construction
    model.rope = type(model.rope)(rope_freq_dim=model.config["rope_freq_dim"], rope_theta=model.config["rope_theta"])
