"""Generate ``docs/api.md``, the API reference of ``MegatronJob``, from the pydantic models.

``python -m megatron_contract.docs --write`` rewrites the file; ``--check`` exits 1 when it differs
from what the models generate (a test runs it too), like :mod:`.crd`.

The models are walked generically: every field of :class:`MegatronJobSpec` and
:class:`MegatronJobStatus`, and of every model nested in them (through ``Optional``, lists and
maps), becomes a row with its YAML name (the camelCase alias), type, default, constraints and
description. Constraints are read from the model's JSON schema, the same one the CRD is made of.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import sys
import types
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python

from megatron_contract.generated import generator_main
from megatron_contract.job import MegatronJobSpec, MegatronJobStatus
from megatron_contract.wire import API_VERSION, KIND, PLURAL, SHORT_NAMES

REPO_ROOT = Path(__file__).resolve().parents[2]
OUTPUT = REPO_ROOT / "docs" / "api.md"

# JSON-schema keywords shown as constraints, and how they read.
_CONSTRAINTS = (
    ("minimum", ">= {}"),
    ("exclusiveMinimum", "> {}"),
    ("maximum", "<= {}"),
    ("exclusiveMaximum", "< {}"),
    ("minLength", "length >= {}"),
    ("maxLength", "length <= {}"),
    ("minItems", "items >= {}"),
    ("maxItems", "items <= {}"),
    ("pattern", "matches `{}`"),
)


# Annotations that are arrays in YAML (``tuple[X, ...]`` included: its first argument is the item type).
_SEQUENCES = (list, tuple, set, frozenset)


@dataclasses.dataclass
class Section:
    """One object of the API: its path in the resource, its model, and its rows."""

    path: str
    model: type[BaseModel]
    rows: list[tuple[str, str, str, str, str]] = dataclasses.field(default_factory=list)


def _anchor(path: str) -> str:
    return path.replace(".", "-").replace("[]", "")


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _strip_none(tp: Any) -> tuple[Any, bool]:
    """The annotation without ``None`` in a union, and whether it was optional."""
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        optional = len(args) < len(get_args(tp))
        return (args[0] if len(args) == 1 else Union[tuple(args)]), optional  # noqa: UP007
    return tp, False


def _nested(tp: Any, path: str) -> list[tuple[str, type[BaseModel]]]:
    """Models reachable from an annotation, with the path their objects have in the resource."""
    tp, _ = _strip_none(tp)
    if _is_model(tp):
        return [(path, tp)]
    origin = get_origin(tp)
    if origin in _SEQUENCES:
        return _nested(get_args(tp)[0], f"{path}[]")
    if origin is dict:
        return _nested(get_args(tp)[1], f"{path}.*")
    if origin in (Union, types.UnionType):
        return [n for a in get_args(tp) for n in _nested(a, path)]
    return []


def _type_name(tp: Any, path: str) -> str:
    """A short, language-neutral rendering of a field's type."""
    tp, _ = _strip_none(tp)
    if _is_model(tp):
        return f"[object](#{_anchor(path)})"
    origin = get_origin(tp)
    if origin in _SEQUENCES:
        return "[]" + _type_name(get_args(tp)[0], f"{path}[]")
    if origin is dict:
        return f"map[{_type_name(get_args(tp)[0], path)}]{_type_name(get_args(tp)[1], f'{path}.*')}"
    if origin is Literal:
        return "string: " + ", ".join(f"`{v}`" for v in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a, path) for a in get_args(tp))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "string: " + ", ".join(f"`{m.value}`" for m in tp)
    simple = {bool: "boolean", int: "integer", float: "number", str: "string", datetime: "string (date-time)"}
    return simple.get(tp, "any")


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        if getattr(field, "default_factory_takes_validated_data", False):  # pydantic >= 2.10
            return "computed from the other fields"
        value = field.default_factory()  # type: ignore[call-arg]
        if isinstance(value, BaseModel):
            return "defaults of its fields"
    else:
        value = field.default
    if value is None:
        return "unset"
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json", by_alias=True, exclude_none=True)
    return f"`{json.dumps(to_jsonable_python(value))}`"


@functools.cache
def _schema(model: type[BaseModel]) -> dict[str, Any]:
    return model.model_json_schema(by_alias=True, mode="validation")


def _schema_node(model: type[BaseModel], key: str) -> dict[str, Any]:
    """The field's JSON-schema node, ``Optional`` collapsed to its non-null option."""
    schema = _schema(model)
    node: dict[str, Any] = dict(schema.get("properties", {}).get(key, {}))
    for option in node.pop("anyOf", []):
        if option.get("type") != "null":
            node = {**option, **node}
    return node


def _constraints(node: dict[str, Any]) -> str:
    found = [text.format(node[k]) for k, text in _CONSTRAINTS if k in node]
    found += [v["message"] for v in node.get("x-kubernetes-validations", [])]
    return "; ".join(found)


def _documented_type(tp: Any) -> Any:
    """The model or enum a field holds (through Optional and lists), whose docstring may describe it."""
    tp, _ = _strip_none(tp)
    if get_origin(tp) in _SEQUENCES:
        return _documented_type(get_args(tp)[0])
    if isinstance(tp, type) and issubclass(tp, BaseModel | enum.Enum):
        return tp
    return None


def _summary(obj: Any) -> str:
    """The first paragraph of an object's docstring on one line, reST literals as Markdown code."""
    doc = (getattr(obj, "__doc__", None) or "") if obj is not None else ""
    return " ".join(doc.strip().split("\n\n")[0].split()).replace("``", "`")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def sections() -> list[Section]:
    """Every object of the resource, spec first, then status, each nested model after its parent."""
    out: list[Section] = []
    queue: list[tuple[str, type[BaseModel]]] = [("spec", MegatronJobSpec), ("status", MegatronJobStatus)]
    seen: set[str] = set()
    while queue:
        path, model = queue.pop(0)
        if path in seen:
            continue
        seen.add(path)
        section = Section(path, model)
        children: list[tuple[str, type[BaseModel]]] = []
        for name, field in model.model_fields.items():
            key = field.alias or name
            child_path = f"{path}.{key}"
            nested = _nested(field.annotation, child_path)
            description = field.description or _summary(_documented_type(field.annotation))
            section.rows.append(
                (
                    f"`{key}`",
                    _type_name(field.annotation, child_path),
                    _default(field),
                    _constraints(_schema_node(model, key)),
                    description,
                )
            )
            children.extend(nested)
        out.append(section)
        # Depth first keeps each object next to its parent in the document.
        queue[:0] = children
    return out


def render() -> str:
    """The whole document, exactly as committed."""
    lines = [
        "# MegatronJob API reference",
        "",
        "<!-- Generated from contract/megatron_contract by `make docs`"
        " (python -m megatron_contract.docs --write). Do not edit by hand. -->",
        "",
        f"`apiVersion: {API_VERSION}`, `kind: {KIND}`, namespaced; plural `{PLURAL}`, short names "
        + ", ".join(f"`{s}`" for s in SHORT_NAMES)
        + ". Field names are as written in YAML. Unknown fields are refused. A default of"
        " `defaults of its fields` means the object is filled in whole from the defaults of its own fields.",
        "",
    ]
    for section in sections():
        lines += [f'<a id="{_anchor(section.path)}"></a>', "", f"## `{section.path}`", "", _summary(section.model), ""]
        rules = _schema(section.model).get("x-kubernetes-validations", [])
        if rules:
            lines.append("Rules across fields (checked by the API server and again by the operator):")
            lines.append("")
            lines += [f"- {r['message']}" for r in rules]
            lines.append("")
        lines += ["| field | type | default | constraints | description |", "| --- | --- | --- | --- | --- |"]
        lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in section.rows]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return generator_main(
        argv,
        description=__doc__.splitlines()[0],
        render=lambda: {OUTPUT: render()},
        source="the models",
        remedy="make docs",
        root=REPO_ROOT,
    )


if __name__ == "__main__":
    sys.exit(main())
