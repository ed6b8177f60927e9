"""``spec.template``: the Kubernetes PodTemplateSpec a job's pods are made from, and what of it is the operator's.

A real GPU cluster wants things of a training pod that only the cluster's owner knows: RDMA
devices, volumes for data, a priority class, a scheduler, tolerations. The template carries them
as Kubernetes spells them; the operator merges it with what it owns (``megatron_operator.builders``):
the trainer container's image, command, ports, environment and GPUs, the pod's labels, owner,
``restartPolicy: Never``, no API credentials. A template that would break any of that is refused
when the job is created, naming the field, by the same rule in CEL (the API server) and in Python
(the operator), like every rule of :data:`megatron_contract.job.SPEC_RULES`.

Only the parts of a pod the rules read are typed here; everything else a PodTemplateSpec may hold
is kept as given (``x-kubernetes-preserve-unknown-fields`` in the CRD) and checked by the API
server when the pod is created.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import ConfigDict, Field

from megatron_contract import wire
from megatron_contract.base import WireModel
from megatron_contract.rules import SpecRule

if TYPE_CHECKING:
    from megatron_contract.job import MegatronJobSpec

GPU_RESOURCE = "nvidia.com/gpu"
#: A non-negative Kubernetes quantity ("500m", "16Gi", "1.5", "2e3"): the API server checks it
#: when the job is created, not when the operator's pod create is refused half an hour later.
QUANTITY_PATTERN = (
    r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
Quantity = Annotated[int, Field(ge=0)] | Annotated[str, Field(pattern=QUANTITY_PATTERN, max_length=64)]

#: Volumes of trainer pods whose names start with this are the operator's (/dev/shm, checkpoints).
VOLUME_PREFIX = "megatron-"
SHM_VOLUME = f"{VOLUME_PREFIX}shm"
CHECKPOINT_VOLUME = f"{VOLUME_PREFIX}checkpoints"
SHM_PATH = "/dev/shm"
#: Labels of trainer pods under the API group are the operator's (job, role, replica, pod index).
LABEL_PREFIX = f"{wire.GROUP}/"
#: The trainer container's ports: the agent's control port and the rendezvous store.
AGENT_PORT_NAME = "agent"
RENDEZVOUS_PORT_NAME = "rendezvous"
_TRAINER = wire.TRAINER_CONTAINER


def is_rdma_resource(name: str) -> bool:
    """Whether a resource name is an RDMA device (``rdma/ib``, ``rdma/hca_shared_devices_a``, ...)."""
    return name.startswith("rdma/") or "rdma" in name.rpartition("/")[2]


class _Open(WireModel):
    """A part of a Kubernetes object: the fields the rules read are typed, the others kept as given."""

    model_config = ConfigDict(extra="allow")


class ContainerPort(_Open):
    """A port of a container (core/v1 ContainerPort; protocol, hostPort, ... kept as given)."""

    container_port: int = Field(ge=1, le=65535, description="Port number.")
    name: str | None = Field(default=None, max_length=15, description="IANA_SVC_NAME of the port.")


class ContainerEnv(_Open):
    """An environment variable (core/v1 EnvVar: value or valueFrom, kept as given)."""

    name: str = Field(min_length=1, max_length=256, description="Variable name.")


class ContainerResources(_Open):
    """Resources of a container (core/v1 ResourceRequirements)."""

    requests: dict[str, Quantity] | None = Field(default=None, max_length=64, description="Resource requests.")
    limits: dict[str, Quantity] | None = Field(default=None, max_length=64, description="Resource limits.")


class VolumeMount(_Open):
    """A volume mount (core/v1 VolumeMount; readOnly, subPath, ... kept as given)."""

    name: str = Field(min_length=1, max_length=63, description="Volume name.")
    mount_path: str = Field(min_length=1, max_length=4096, description="Path in the container.")


class TemplateContainer(_Open):
    """A container of the template (core/v1 Container). One named ``trainer`` is merged into the
    operator's trainer container; the others (sidecars, init containers) run as given."""

    name: str = Field(min_length=1, max_length=63, description="Container name; trainer is the operator's.")
    image: str | None = Field(
        default=None, max_length=4096, description="Image; for the trainer container, spec.image (or left out)."
    )
    command: list[str] | None = Field(
        default=None, max_length=256, description="Command; for the trainer container, spec.command (or left out)."
    )
    args: list[str] | None = Field(
        default=None, max_length=4096, description="Arguments; for the trainer container, spec.args (or left out)."
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(
        default=None, description="Image pull policy."
    )
    env: list[ContainerEnv] | None = Field(
        default=None, max_length=256, description="Environment; not the operator's MEGATRON_ variables."
    )
    ports: list[ContainerPort] | None = Field(
        default=None, max_length=64, description="Ports; not the agent's 29400 and 29401."
    )
    resources: ContainerResources | None = Field(
        default=None, description="Resources; nvidia.com/gpu only in the trainer container, equal to gpusPerPod."
    )
    volume_mounts: list[VolumeMount] | None = Field(default=None, max_length=64, description="Volume mounts.")


class TemplateVolume(_Open):
    """A volume of the template (core/v1 Volume: its source kept as given)."""

    name: str = Field(min_length=1, max_length=63, description="Volume name; not starting with megatron-.")


class PodTemplateMetadata(WireModel):
    """Labels and annotations added to every trainer pod (the operator's labels win)."""

    labels: dict[str, str] | None = Field(
        default=None, max_length=256, description="Labels; not under megatron.dev/ (the operator's)."
    )
    annotations: dict[str, str] | None = Field(default=None, max_length=256, description="Annotations.")


class TemplatePodSpec(_Open):
    """The pod's spec (core/v1 PodSpec), merged with what the operator owns.

    Everything a PodSpec holds may be given (affinity, tolerations, priorityClassName,
    schedulerName, runtimeClassName, hostNetwork, imagePullSecrets, securityContext, volumes,
    sidecars, init containers, ...). The operator sets restartPolicy Never, no service-account
    token, the hostname and subdomain, and the trainer container; it adds a memory-backed /dev/shm,
    secure defaults (see docs/operations.md) and spreading over failure domains.
    """

    containers: list[TemplateContainer] | None = Field(
        default=None, max_length=32, description="Containers: trainer (merged into the operator's) and sidecars."
    )
    init_containers: list[TemplateContainer] | None = Field(
        default=None, max_length=32, description="Init containers (and native sidecars)."
    )
    volumes: list[TemplateVolume] | None = Field(default=None, max_length=256, description="Volumes.")
    restart_policy: str | None = Field(default=None, description="Never, or left out: failed pods are replaced.")
    automount_service_account_token: bool | None = Field(
        default=None, description="false, or left out: trainer pods get no Kubernetes API credentials."
    )
    hostname: str | None = Field(default=None, description="Set by the operator (the pod's name): leave it out.")
    subdomain: str | None = Field(default=None, description="Set by the operator (the job's Service): leave it out.")
    node_selector: dict[str, str] | None = Field(
        default=None, max_length=64, description="Node selector (or spec.nodeSelector, not both)."
    )
    tolerations: list[dict[str, Any]] | None = Field(
        default=None, max_length=64, description="Tolerations (or spec.tolerations, not both)."
    )


class PodTemplate(WireModel):
    """A PodTemplateSpec: metadata and spec of the job's pods, merged with what the operator owns."""

    metadata: PodTemplateMetadata | None = Field(default=None, description="Labels and annotations.")
    spec: TemplatePodSpec | None = Field(default=None, description="The pod spec.")

    def trainer(self) -> TemplateContainer | None:
        """The template's container named trainer, if any."""
        if self.spec is None:
            return None
        return next((c for c in self.spec.containers or [] if c.name == _TRAINER), None)

    def all_containers(self) -> Iterator[TemplateContainer]:
        """Containers and init containers."""
        if self.spec is not None:
            yield from self.spec.containers or []
            yield from self.spec.init_containers or []


# CEL building blocks. `has()` of a missing parent is an error that `&&` with false absorbs.
_SPEC = "has(self.template) && has(self.template.spec)"
_CONTAINERS = f"{_SPEC} && has(self.template.spec.containers)"


def _cel_trainer_has(condition: str) -> str:
    """CEL: the template's container named trainer meets ``condition`` (on ``c``)."""
    return f"({_CONTAINERS} && self.template.spec.containers.exists(c, c.name == '{_TRAINER}' && {condition}))"


def _cel_trainer(condition: str) -> str:
    """CEL: no template container named trainer meets ``condition`` (on ``c``)."""
    return "!" + _cel_trainer_has(condition)


def _cel_any_container(condition: str) -> str:
    """CEL: no container nor init container of the template meets ``condition`` (on ``c``)."""
    lists = ("containers", "initContainers")
    return " && ".join(
        f"!({_SPEC} && has(self.template.spec.{f}) && self.template.spec.{f}.exists(c, {condition}))" for f in lists
    )


def _trainer_of(s: MegatronJobSpec) -> TemplateContainer | None:
    return s.template.trainer() if s.template is not None else None


def _containers_of(s: MegatronJobSpec) -> list[TemplateContainer]:
    return list(s.template.all_containers()) if s.template is not None else []


def _pod_of(s: MegatronJobSpec) -> TemplatePodSpec | None:
    return s.template.spec if s.template is not None else None


def _mounts(c: TemplateContainer | None) -> list[VolumeMount]:
    return list(c.volume_mounts or []) if c is not None else []


def _gpus(c: TemplateContainer) -> dict[str, Quantity]:
    r = c.resources
    if r is None:
        return {}
    return {
        f"{k}.{GPU_RESOURCE}": v
        for k, d in (("limits", r.limits), ("requests", r.requests))
        if d
        for key, v in d.items()
        if key == GPU_RESOURCE
    }


def _trainer_gpus_ok(s: MegatronJobSpec) -> bool:
    c = _trainer_of(s)
    return c is None or all(str(v) == str(s.gpus_per_pod) for v in _gpus(c).values())


_OWN_PORTS = f"p.containerPort == {wire.AGENT_PORT} || p.containerPort == {wire.RENDEZVOUS_PORT}"
_OWN_PORT_NAMES = f"has(p.name) && (p.name == '{AGENT_PORT_NAME}' || p.name == '{RENDEZVOUS_PORT_NAME}')"
_OWN_ENV = "[" + ", ".join(f"'{n}'" for n in wire.OPERATOR_ENV) + "]"
_GPU_IN = (
    f"has(c.resources) && ((has(c.resources.limits) && '{GPU_RESOURCE}' in c.resources.limits) || "
    f"(has(c.resources.requests) && '{GPU_RESOURCE}' in c.resources.requests))"
)


def _port_clash(c: TemplateContainer) -> bool:
    return any(
        p.container_port in (wire.AGENT_PORT, wire.RENDEZVOUS_PORT)
        or (c.name == _TRAINER and p.name in (AGENT_PORT_NAME, RENDEZVOUS_PORT_NAME))
        for p in c.ports or []
    )


def _shorthand_rule(
    field: str,
    cel_shorthand_set: str,
    cel_template_set: str,
    shorthand_set: Callable[[MegatronJobSpec], bool],
    template_set: Callable[[MegatronJobSpec], bool],
    template_field: str,
) -> SpecRule:
    """spec.<field> is a shorthand for a template field: setting both is refused (two ways to say one thing)."""
    return SpecRule(
        f"!({cel_shorthand_set}) || !({cel_template_set})",
        f"spec.{field} and spec.template.{template_field} are both set: give one (spec.{field} is a shorthand "
        f"for spec.template.{template_field})",
        lambda s: not (shorthand_set(s) and template_set(s)),
    )


def _trainer_has(attr: str) -> Callable[[MegatronJobSpec], bool]:
    return lambda s: (c := _trainer_of(s)) is not None and getattr(c, attr) is not None


def _pod_has(attr: str) -> Callable[[MegatronJobSpec], bool]:
    return lambda s: (p := _pod_of(s)) is not None and getattr(p, attr) is not None


TEMPLATE_RULES: tuple[SpecRule, ...] = (
    SpecRule(
        f"!({_SPEC} && has(self.template.spec.restartPolicy)) || self.template.spec.restartPolicy == 'Never'",
        "spec.template.spec.restartPolicy must be Never (or left out): a failed pod is replaced by a spare, "
        "never restarted in place",
        lambda s: (p := _pod_of(s)) is None or p.restart_policy in (None, "Never"),
    ),
    SpecRule(
        f"!({_SPEC} && has(self.template.spec.automountServiceAccountToken)) || "
        "!self.template.spec.automountServiceAccountToken",
        "spec.template.spec.automountServiceAccountToken must be false (or left out): trainer pods get no "
        "Kubernetes API credentials",
        lambda s: (p := _pod_of(s)) is None or not p.automount_service_account_token,
    ),
    SpecRule(
        f"!({_SPEC} && (has(self.template.spec.hostname) || has(self.template.spec.subdomain)))",
        "spec.template.spec.hostname and spec.template.spec.subdomain are set by the operator "
        "(the pod's name, the job's Service): leave them out",
        lambda s: (p := _pod_of(s)) is None or (p.hostname is None and p.subdomain is None),
    ),
    SpecRule(
        _cel_any_container(
            f"has(c.ports) && c.ports.exists(p, {_OWN_PORTS} || (c.name == '{_TRAINER}' && {_OWN_PORT_NAMES}))"
        ),
        f"spec.template.spec.containers[].ports must not use {wire.AGENT_PORT} or {wire.RENDEZVOUS_PORT} "
        f"(nor, in the trainer container, the names {AGENT_PORT_NAME} and {RENDEZVOUS_PORT_NAME}): "
        "the trainer agent's control and rendezvous ports",
        lambda s: not any(_port_clash(c) for c in _containers_of(s)),
    ),
    SpecRule(
        _cel_trainer("has(c.image) && c.image != self.image"),
        "spec.template.spec.containers[trainer].image must equal spec.image (or be left out)",
        lambda s: (c := _trainer_of(s)) is None or c.image in (None, s.image),
    ),
    SpecRule(
        _cel_trainer("has(c.command) && !(has(self.command) && c.command == self.command)"),
        "spec.template.spec.containers[trainer].command must equal spec.command (or be left out)",
        lambda s: (c := _trainer_of(s)) is None or c.command is None or c.command == s.command,
    ),
    SpecRule(
        _cel_trainer("has(c.args) && !(has(self.args) && c.args == self.args)"),
        "spec.template.spec.containers[trainer].args must equal spec.args (or be left out)",
        lambda s: (c := _trainer_of(s)) is None or c.args is None or c.args == s.args,
    ),
    SpecRule(
        _cel_trainer(
            "has(c.resources) && ("
            + " || ".join(
                # `x in [value]`, not string(value): the API server's cost estimate of a quantity's
                # string (unbounded) across every container would exceed the rule budget.
                f"(has(c.resources.{f}) && '{GPU_RESOURCE}' in c.resources.{f} && "
                f"!(self.gpusPerPod in [c.resources.{f}['{GPU_RESOURCE}']] || "
                f"string(self.gpusPerPod) in [c.resources.{f}['{GPU_RESOURCE}']]))"
                for f in ("limits", "requests")
            )
            + ")"
        ),
        f"spec.template.spec.containers[trainer].resources[{GPU_RESOURCE}] must equal spec.gpusPerPod "
        "(or be left out: it is set from it)",
        _trainer_gpus_ok,
    ),
    SpecRule(
        _cel_any_container(f"c.name != '{_TRAINER}' && {_GPU_IN}"),
        f"spec.template.spec.containers[].resources: only the trainer container gets {GPU_RESOURCE} "
        "(spec.gpusPerPod); sidecars and init containers request none",
        lambda s: not any(c.name != _TRAINER and _gpus(c) for c in _containers_of(s)),
    ),
    SpecRule(
        _cel_trainer(f"has(c.env) && c.env.exists(e, e.name in {_OWN_ENV})"),
        "spec.template.spec.containers[trainer].env must not set the operator's variables "
        f"({', '.join(wire.OPERATOR_ENV)})",
        lambda s: (c := _trainer_of(s)) is None or not any(e.name in wire.OPERATOR_ENV for e in c.env or []),
    ),
    SpecRule(
        f"!has(self.env) || !self.env.exists(e, e.name in {_OWN_ENV})",
        f"spec.env must not set the operator's variables ({', '.join(wire.OPERATOR_ENV)})",
        lambda s: not any(e.name in wire.OPERATOR_ENV for e in s.env),
    ),
    SpecRule(
        f"!(has(self.template) && has(self.template.metadata) && has(self.template.metadata.labels) && "
        f"self.template.metadata.labels.exists(k, k.startsWith('{LABEL_PREFIX}')))",
        f"spec.template.metadata.labels must not use the {LABEL_PREFIX} prefix: those labels are the operator's",
        lambda s: (
            s.template is None
            or s.template.metadata is None
            or not any(k.startswith(LABEL_PREFIX) for k in s.template.metadata.labels or {})
        ),
    ),
    SpecRule(
        f"!({_SPEC} && has(self.template.spec.volumes) && "
        f"self.template.spec.volumes.exists(v, v.name.startsWith('{VOLUME_PREFIX}')))",
        f"spec.template.spec.volumes[].name must not start with {VOLUME_PREFIX}: those volumes are the operator's",
        lambda s: (p := _pod_of(s)) is None or not any(v.name.startswith(VOLUME_PREFIX) for v in p.volumes or []),
    ),
    SpecRule(
        "!has(self.shmSize) || "
        + _cel_trainer(f"has(c.volumeMounts) && c.volumeMounts.exists(m, m.mountPath == '{SHM_PATH}')"),
        f"spec.shmSize sizes the operator's {SHM_PATH}, and spec.template.spec.containers[trainer].volumeMounts "
        f"mounts its own there: give one",
        lambda s: s.shm_size is None or not any(m.mount_path == SHM_PATH for m in _mounts(_trainer_of(s))),
    ),
    SpecRule(
        "!(has(self.checkpoint) && has(self.checkpoint.volumeClaimName)) || "
        + _cel_trainer("has(c.volumeMounts) && c.volumeMounts.exists(m, m.mountPath == self.checkpoint.path)"),
        "spec.template.spec.containers[trainer].volumeMounts mounts spec.checkpoint.path, which "
        "spec.checkpoint.volumeClaimName already mounts: give one",
        lambda s: (
            s.checkpoint is None
            or s.checkpoint.volume_claim_name is None
            or not any(m.mount_path == s.checkpoint.path for m in _mounts(_trainer_of(s)))
        ),
    ),
    _shorthand_rule(
        "resources",
        "has(self.resources) && ((has(self.resources.requests) && size(self.resources.requests) > 0) || "
        "(has(self.resources.limits) && size(self.resources.limits) > 0))",
        _cel_trainer_has("has(c.resources)"),
        lambda s: bool(s.resources.requests or s.resources.limits),
        _trainer_has("resources"),
        "spec.containers[trainer].resources",
    ),
    _shorthand_rule(
        "env",
        "has(self.env) && size(self.env) > 0",
        _cel_trainer_has("has(c.env)"),
        lambda s: bool(s.env),
        _trainer_has("env"),
        "spec.containers[trainer].env",
    ),
    _shorthand_rule(
        "imagePullPolicy",
        "has(self.imagePullPolicy)",
        _cel_trainer_has("has(c.imagePullPolicy)"),
        lambda s: s.image_pull_policy is not None,
        _trainer_has("image_pull_policy"),
        "spec.containers[trainer].imagePullPolicy",
    ),
    _shorthand_rule(
        "nodeSelector",
        "has(self.nodeSelector) && size(self.nodeSelector) > 0",
        f"{_SPEC} && has(self.template.spec.nodeSelector)",
        lambda s: bool(s.node_selector),
        _pod_has("node_selector"),
        "spec.nodeSelector",
    ),
    _shorthand_rule(
        "tolerations",
        "has(self.tolerations) && size(self.tolerations) > 0",
        f"{_SPEC} && has(self.template.spec.tolerations)",
        lambda s: bool(s.tolerations),
        _pod_has("tolerations"),
        "spec.tolerations",
    ),
)
