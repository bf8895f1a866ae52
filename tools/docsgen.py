"""The docs site's generated references: every deployment-file key from the config models, every API field from
the protos' comments. Generated when the site is built (tools/mkdocs_hooks.py), so they cannot drift from the code.

`python -m tools.docsgen config|api` prints one as markdown.

A key's description is its comment in h3serve/common/config/: the comment block right above the field, then its
same-line comment with the comment lines that continue it (a line that starts in lower case or with "(", or one
that closes a parenthesis left open). What it refuses: its type (checked strictly), its bounds, and the messages of
the validators that check it.
"""

from __future__ import annotations

import ast
import inspect
import io
import json
import re
import sys
import tempfile
import textwrap
import tokenize
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import AfterValidator, BaseModel, BeforeValidator
from pydantic.fields import FieldInfo

from h3serve.common import config

ROOT = Path(__file__).resolve().parents[1]
PROTOS = ROOT / "protos"
# Set from [model] into every section that has it: not a key of those sections' own.
FROM_MODEL = {"geometry"}
# The nested tables with keys of their own: (the heading, the model).
SUBTABLES = {"dit.adapters.<name>": config.AdapterSource}


# --- the configuration reference --------------------------------------------------------------------------------


def sections() -> dict[str, type[BaseModel]]:
    """Every table of a deployment file and the model that checks it."""
    return {**config.SECTION_MODELS, **SUBTABLES}


def section_keys(model: type[BaseModel]) -> list[str]:
    return [name for name in model.model_fields if name not in FROM_MODEL]


def config_reference() -> str:
    defaults = config.DeployConfig()
    out = [
        "# Configuration reference",
        "",
        "Every key of every section of a deployment file (`--config`), generated from the models in "
        "`h3serve/common/config/` when the site is built. Values are checked strictly, as TOML gives them: the "
        'string `"8"` is not the integer 8, and 1 is not `true`; an unknown key or section is refused, naming it. '
        "A service section's `model_dir` and the canvas keys default to `[model]`'s. How the sections fit "
        "together: [configuration.md](../configuration.md).",
    ]
    for name, model in sections().items():
        instance = getattr(defaults, name, None) if name in config.SERVICES + ("gateway", "supervisor") else None
        out += ["", f"## [{name}]", ""]
        if model.__doc__ and model.__doc__ is not BaseModel.__doc__:
            out += [_oneline(inspect.getdoc(model) or ""), ""]
        out += ["| key | type | default | checked | what it is |", "|---|---|---|---|---|"]
        notes = _field_notes(model)
        checks = _validator_messages(model)
        for key in section_keys(model):
            field = model.model_fields[key]
            default = getattr(instance, key) if instance is not None else _default(field)
            refuses = [*_bounds(field), *checks.get(key, []), *_annotated_messages(field)]
            kind, shown = _type_name(field.annotation), _render(key, default)
            row = [f"`{key}`", kind, shown, "; ".join(refuses), notes.get(key, "")]
            out.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return "\n".join(out) + "\n"


def _default(field: FieldInfo) -> Any:
    if field.default_factory is not None:
        return field.default_factory()  # type: ignore[call-arg]
    return "(required)" if field.is_required() else field.default


def _render(key: str, value: Any) -> str:
    if value == "(required)":
        return "required"
    if value is None:
        return "unset"
    if isinstance(value, BaseModel):
        value = value.model_dump()
    if key.endswith("bytes") and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"`{value}` ({_size(value)})"
    return f"`{json.dumps(value, default=list)}`".replace('`""`', '`""` (empty)')


def _size(value: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if value % (1 << shift) == 0:
            return f"{value >> shift} {unit}"
    return str(value)


def _type_name(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _type_name(args[0])
    if origin is Literal:
        return "one of " + ", ".join(f"`{json.dumps(a)}`" for a in args)
    if origin in (Union, types.UnionType):
        kinds = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(kinds) + (" (may be left unset)" if type(None) in args else "")
    if origin is tuple:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return f"table of {_type_name(args[0])} to {_type_name(args[1])}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "table" if annotation is not config.AdapterSource else "path or table (below)"
    names = {int: "integer", float: "number", str: "string", bool: "boolean"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


_BOUNDS: dict[type, Callable[[Any], str]] = {
    annotated_types.Gt: lambda c: f"> {c.gt}",
    annotated_types.Ge: lambda c: f">= {c.ge}",
    annotated_types.Lt: lambda c: f"< {c.lt}",
    annotated_types.Le: lambda c: f"<= {c.le}",
    annotated_types.MinLen: lambda c: f"at least {c.min_length} item(s)",
}


def _metadata(field: FieldInfo) -> Iterator[Any]:
    """The field's constraints and validators, also those inside its type (a table's keys and values)."""
    yield from field.metadata
    todo = [field.annotation]
    while todo:
        annotation = todo.pop()
        if get_origin(annotation) is Annotated:
            yield from get_args(annotation)[1:]
        todo += [a for a in get_args(annotation) if not isinstance(a, (str, int, float))]


def _bounds(field: FieldInfo) -> list[str]:
    found = []
    for item in _metadata(field):
        metadata = getattr(item, "metadata", [item])  # a FieldInfo inside Annotated carries its own constraints
        found += [_BOUNDS[type(c)](c) for c in metadata if type(c) in _BOUNDS]
    return list(dict.fromkeys(found))


def _annotated_messages(field: FieldInfo) -> list[str]:
    return [
        m
        for item in _metadata(field)
        if isinstance(item, (AfterValidator, BeforeValidator))
        for m in _raised(item.func)
    ]


def _validator_messages(model: type[BaseModel]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for decorator in model.__pydantic_decorators__.field_validators.values():
        for key in decorator.info.fields:
            found.setdefault(key, []).extend(_raised(decorator.func))
    return found


def _raised(func: Callable) -> list[str]:
    """The messages of the ValueErrors `func` raises, with `…` for what each fills in."""
    func = getattr(func, "__func__", func)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    except (OSError, TypeError):
        return []
    messages = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
            message = _literal(node.exc.args[0], getattr(func, "__globals__", {}))
            if message:
                messages.append(message)
    return messages


def _literal(node: ast.expr, names: dict) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(_literal(v, names) if isinstance(v, ast.Constant) else "…" for v in node.values)
    if isinstance(node, ast.Name) and isinstance(names.get(node.id), str):
        return names[node.id]
    return ""


def _field_notes(model: type[BaseModel]) -> dict[str, str]:
    """Each field's comment, from the class that declares it (the most derived one)."""
    notes: dict[str, str] = {}
    for klass in reversed(model.__mro__):
        if issubclass(klass, BaseModel) and klass is not BaseModel:
            notes.update(_class_comments(klass))
    return notes


def _class_comments(klass: type) -> dict[str, str]:
    source = textwrap.dedent(inspect.getsource(klass))
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT]
    comments = {t.start[0]: t.string.lstrip("#").strip() for t in tokens}
    alone = {t.start[0] for t in tokens if t.line.lstrip().startswith("#")}  # comment lines, not code with a comment
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    fields = [n for n in body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    notes, taken = {}, set()
    for node in fields:
        above: list[str] = []
        line = node.lineno - 1
        while line in alone and line not in taken:
            above.insert(0, comments[line])
            line -= 1
        own, line = [], node.end_lineno or node.lineno
        if line in comments:
            own.append(comments[line])
            while line + 1 in alone and _continues(" ".join(own), comments[line + 1]):
                line += 1
                own.append(comments[line])
                taken.add(line)
        notes[node.target.id] = " ".join(above + own)  # type: ignore[union-attr]
    return notes


def _continues(so_far: str, line: str) -> bool:
    return so_far.count("(") > so_far.count(")") or bool(re.match(r"[a-z(]", line))


# --- the API reference ------------------------------------------------------------------------------------------

# FileDescriptorProto's field numbers in a SourceCodeInfo path
MESSAGE, ENUM, SERVICE, SYNTAX = 4, 5, 6, 12
FIELD, NESTED, NESTED_ENUM, METHOD, VALUE = 2, 3, 4, 2, 2


def descriptor_set():
    """The protos compiled with their comments (protoc's source info), through grpcio-tools."""
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTOS)) for p in (PROTOS / "h3serve" / "v1").glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        if protoc.main(["protoc", f"-I{PROTOS}", "--include_source_info", f"--descriptor_set_out={out}", *protos]):
            raise RuntimeError(f"protoc could not compile {PROTOS} (its errors are above)")
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def api_reference() -> str:
    out = [
        "# API reference (`h3serve.v1`)",
        "",
        "Every service, message, field and enum of `protos/h3serve/v1/`, with the protos' own comments, generated "
        "when the site is built. How the API behaves as a whole: [api.md](../api.md).",
    ]
    for file in descriptor_set().file:
        lines = (PROTOS / file.name).read_text().splitlines()
        comments = {tuple(loc.path): _proto_comment(lines, loc.span) for loc in file.source_code_info.location}
        header = [loc for loc in file.source_code_info.location if list(loc.path) == [SYNTAX]]
        out += ["", f"## {Path(file.name).name}", ""]
        if header and header[0].leading_detached_comments:
            out += [_oneline(header[0].leading_detached_comments[0]), ""]
        for i, service in enumerate(file.service):
            out += _service(service, comments, (SERVICE, i))
        for i, message in enumerate(file.message_type):
            out += _message(message, comments, (MESSAGE, i), message.name)
        for i, enum in enumerate(file.enum_type):
            out += _enum(enum, comments, (ENUM, i), enum.name)
    return "\n".join(out) + "\n"


def _proto_comment(lines: list[str], span) -> str:
    """The comment lines right above an element (at its own indentation), then its same-line comment and the lines
    that continue it (comment lines starting at the same column). protoc's own attribution gives such continuation
    lines to the next element."""
    first, last = span[0], span[2] if len(span) == 4 else span[0]
    indent = len(lines[first]) - len(lines[first].lstrip())
    above: list[str] = []
    row = first - 1
    while row >= 0 and lines[row].lstrip().startswith("//") and lines[row].index("//") == indent:
        above.insert(0, lines[row].strip()[2:])
        row -= 1
    own, code = [], lines[last].split("//", 1)
    if len(code) == 2 and code[0].strip():
        column, row = len(code[0]), last + 1
        own.append(code[1])
        while row < len(lines) and lines[row].lstrip().startswith("//") and lines[row].index("//") == column:
            own.append(lines[row].strip()[2:])
            row += 1
    return _oneline(" ".join(above + own))


def _paragraph(text: str) -> list[str]:
    return [text, ""] if text else []


def _oneline(text: str) -> str:
    return " ".join(text.split())


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _service(service, comments, path) -> list[str]:
    out = [f"### service {service.name}", "", *_paragraph(comments.get(path, ""))]
    out += ["| method | request | response | what it does |", "|---|---|---|---|"]
    for i, method in enumerate(service.method):
        request = ("stream " if method.client_streaming else "") + _short(method.input_type)
        response = ("stream " if method.server_streaming else "") + _short(method.output_type)
        text = comments.get((*path, METHOD, i), "")
        out.append(f"| `{method.name}` | `{request}` | `{response}` | {_cell(text)} |")
    return [*out, ""]


def _message(message, comments, path, name) -> list[str]:
    if message.options.map_entry:
        return []
    out = [f"### message {name}", "", *_paragraph(comments.get(path, ""))]
    if message.field:
        maps = {f".{n.name}": n for n in message.nested_type if n.options.map_entry}
        out += ["| field | number | type | what it is |", "|---|---|---|---|"]
        for i, field in enumerate(message.field):
            text = comments.get((*path, FIELD, i), "")
            out.append(f"| `{field.name}` | {field.number} | `{_field_type(field, maps)}` | {_cell(text)} |")
        out.append("")
    for i, nested in enumerate(message.nested_type):
        out += _message(nested, comments, (*path, NESTED, i), f"{name}.{nested.name}")
    for i, enum in enumerate(message.enum_type):
        out += _enum(enum, comments, (*path, NESTED_ENUM, i), f"{name}.{enum.name}")
    return out


def _enum(enum, comments, path, name) -> list[str]:
    out = [f"### enum {name}", "", *_paragraph(comments.get(path, ""))]
    out += ["| value | number | what it means |", "|---|---|---|"]
    for i, value in enumerate(enum.value):
        out.append(f"| `{value.name}` | {value.number} | {_cell(comments.get((*path, VALUE, i), ''))} |")
    return [*out, ""]


_SCALARS = {
    1: "double", 2: "float", 3: "int64", 4: "uint64", 5: "int32", 6: "fixed64", 7: "fixed32", 8: "bool",
    9: "string", 12: "bytes", 13: "uint32", 15: "sfixed32", 16: "sfixed64", 17: "sint32", 18: "sint64",
}  # fmt: skip


def _field_type(field, maps: dict) -> str:
    entry = next((m for suffix, m in maps.items() if field.type_name.endswith(suffix)), None)
    if entry is not None:
        key, value = entry.field
        return f"map<{_field_type(key, {})}, {_field_type(value, {})}>"
    kind = _short(field.type_name) if field.type_name else _SCALARS[field.type]
    repeated = field.label == 3
    optional = field.proto3_optional
    return ("repeated " if repeated else "optional " if optional else "") + kind


def _short(type_name: str) -> str:
    return type_name.removeprefix(".h3serve.v1.")


GENERATED = {"reference/config.md": config_reference, "reference/api.md": api_reference}

if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else ""
    if which not in ("config", "api"):
        sys.exit("usage: python -m tools.docsgen config|api")
    print(config_reference() if which == "config" else api_reference(), end="")
