"""Generate the MegatronJob CRD from the pydantic models, the single source of truth.

``python -m megatron_contract.crd --write`` rewrites ``crds/`` and the chart's copy;
``--check`` exits 1 when either differs from what the models generate (a test runs it too).

Pydantic emits JSON Schema 2020-12; Kubernetes wants a *structural* OpenAPI v3.0 schema, so
``$ref`` is inlined, ``Optional`` collapses to the inner type, ``int | str`` becomes
``x-kubernetes-int-or-string`` (keeping the string's pattern and the integer's minimum), numeric
exclusive bounds take their v3.0 form, and ``additionalProperties: false`` is dropped (the API
server prunes and, with kubectl's strict field validation, rejects unknown fields instead), while
``additionalProperties: true`` (an open part of a pod template; the status, which keeps fields
written by another version of the operator: see ``base.OpenWireModel``) becomes
``x-kubernetes-preserve-unknown-fields``. The spec stays closed: a field a person mistyped is
pruned or refused there, never kept.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic.json_schema import GenerateJsonSchema, NoDefault
from pydantic_core import core_schema

from megatron_contract.generated import generator_main
from megatron_contract.job import NAME_RULE, MegatronJobSpec, MegatronJobStatus
from megatron_contract.wire import GROUP, KIND, PLURAL, SHORT_NAMES, SINGULAR, VERSION

CRD_NAME = f"{PLURAL}.{GROUP}"
CRD_FILE = f"{CRD_NAME}.yaml"
REPO_ROOT = Path(__file__).resolve().parents[2]
OUTPUTS = (REPO_ROOT / "crds" / CRD_FILE, REPO_ROOT / "charts" / "megatron-operator" / "crds" / CRD_FILE)

_DROP_KEYS = {"title", "examples", "$defs"}

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Coarse state of the job."},
    {"name": "Mesh", "type": "string", "jsonPath": ".status.mesh", "description": "dp x tp x pp (x cp)."},
    {"name": "Ready", "type": "string", "jsonPath": ".status.ready", "description": "Ready/desired worker pods."},
    {"name": "Spares", "type": "integer", "jsonPath": ".status.sparesReady", "description": "Hot spares ready."},
    {
        "name": "Recoveries",
        "type": "integer",
        "jsonPath": ".status.recoveries",
        "description": "Plans after the first.",
    },
    {"name": "Epoch", "type": "integer", "jsonPath": ".status.epoch", "priority": 1, "description": "Plan epoch."},
    {"name": "Step", "type": "integer", "jsonPath": ".status.step", "priority": 1, "description": "Last step."},
    {
        "name": "Copies",
        "type": "integer",
        "jsonPath": ".status.buddyCopyStep",
        "priority": 1,
        "description": "Every pod holds buddy copies at least this new (distributed optimizer).",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    """Turn one pydantic JSON-Schema node into its structural OpenAPI v3.0 form."""
    if isinstance(node, list):
        return [_structural(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
        extra = {k: v for k, v in node.items() if k != "$ref"}
        return _structural({**target, **extra}, defs)
    node = dict(node)
    if "anyOf" in node:
        options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
        types = sorted(o.get("type", "") for o in options)
        if types == ["integer", "string"]:
            node["x-kubernetes-int-or-string"] = True
            # Each option's own bounds apply to values of its type only (a pattern and a length to
            # strings, a minimum to integers), so they can sit side by side on the int-or-string node.
            for option in options:
                node.update({k: v for k, v in option.items() if k in ("pattern", "maxLength", "minimum")})
        elif len(options) == 1:
            node = {**options[0], **node}
            if "$ref" in node:
                return _structural({k: v for k, v in node.items() if k != "default" or v is not None}, defs)
        else:
            raise ValueError(f"cannot express anyOf {options} in a structural schema")
        if node.get("default", 0) is None:
            del node["default"]
    if "const" in node:
        node["enum"] = [node.pop("const")]
    for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(bound), (int, float)) and not isinstance(node.get(bound), bool):
            node[plain] = node.pop(bound)
            node[bound] = True
    if node.get("additionalProperties") is False:
        del node["additionalProperties"]
    elif node.get("additionalProperties") is True:
        # An open object (a part of a pod template, a toleration): the fields it types are checked,
        # the others kept as given for the API server to check when the pod is created.
        del node["additionalProperties"]
        node["x-kubernetes-preserve-unknown-fields"] = True
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP_KEYS:
            continue
        if key == "properties":
            out[key] = {name: _structural(sub, defs) for name, sub in value.items()}
        elif key in ("items", "additionalProperties"):
            out[key] = _structural(value, defs)
        else:
            out[key] = value
    return out


class _WithFactoryDefaults(GenerateJsonSchema):
    """Emit the value of ``default_factory`` fields as their default.

    Pydantic fills nested objects (``model``, ``training``, ...) from factories; the API server
    must default them the same way, whole, so that CEL rules can read every field.
    """

    def get_default_value(self, schema: core_schema.WithDefaultSchema) -> Any:
        factory = schema.get("default_factory")
        if factory is None or schema.get("default_factory_takes_data"):
            return super().get_default_value(schema)
        value = factory()  # type: ignore[call-arg]
        if isinstance(value, BaseModel):
            return value.model_dump(mode="json", by_alias=True, exclude_none=True)
        return value if value is not None else NoDefault


def model_schema(model: type[MegatronJobSpec] | type[MegatronJobStatus]) -> dict[str, Any]:
    """The structural OpenAPI schema of a model."""
    raw = model.model_json_schema(by_alias=True, mode="validation", schema_generator=_WithFactoryDefaults)
    result: dict[str, Any] = _structural(raw, raw.get("$defs", {}))
    return result


#: Status fields the API server keeps as written, unchecked: the plan's members, one per pod (at 4096
#: pods, 620 of the plan's 634 kB). Checking them against the schema on every status write (validation
#: with ratcheting, pruning, defaulting) was more than half of kube-apiserver's time per write: 301 ms
#: at 4096 pods against 140 ms unchecked (median of 20 writes, 2 cores). Their one writer, the operator,
#: validates the plan with the contract's models, and reads the status back through them too; they
#: stay documented in docs/api.md. The plan's other fields are still checked.
UNCHECKED_STATUS_FIELDS: tuple[tuple[str, ...], ...] = (("plan", "members"),)


def _uncheck(schema: dict[str, Any], path: tuple[str, ...]) -> None:
    """Drop the field at ``path`` from ``schema``: its parent, which keeps unknown fields, keeps it as given."""
    *parents, name = path
    for part in parents:
        schema = schema["properties"][part]
    if not schema.get("x-kubernetes-preserve-unknown-fields"):
        raise ValueError(f"{'.'.join(path)}: its parent does not keep unknown fields, the API server would prune it")
    del schema["properties"][name]
    if name in schema.get("required", []):
        schema["required"] = [r for r in schema["required"] if r != name]


def build_crd(unchecked: tuple[tuple[str, ...], ...] = UNCHECKED_STATUS_FIELDS) -> dict[str, Any]:
    """The whole CustomResourceDefinition object, the status fields ``unchecked`` left to the operator."""
    spec = model_schema(MegatronJobSpec)
    status = model_schema(MegatronJobStatus)
    for path in unchecked:
        _uncheck(status, path)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "annotations": {"megatron.dev/generated-by": "python -m megatron_contract.crd --write; do not edit"},
        },
        "spec": {
            "group": GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": SINGULAR,
                "shortNames": list(SHORT_NAMES),
                "categories": ["all"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "An elastic Megatron-Core training job that survives GPU failures in place.",
                            "required": ["spec"],
                            "x-kubernetes-validations": [NAME_RULE],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec,
                                "status": status,
                            },
                        }
                    },
                }
            ],
        },
    }


def render() -> str:
    """The CRD as YAML text, exactly as committed."""
    header = "# Generated from contract/megatron_contract by `make crds`. Do not edit by hand.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=100)


def main(argv: list[str] | None = None) -> int:
    text = render()
    return generator_main(
        argv,
        description=__doc__.splitlines()[0],
        render=lambda: dict.fromkeys(OUTPUTS, text),
        source="the models",
        remedy="make crds",
        root=REPO_ROOT,
    )


if __name__ == "__main__":
    sys.exit(main())
