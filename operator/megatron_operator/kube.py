"""The one module that talks to the API server.

Calls go through the official (synchronous) client on a bounded thread pool, so the kopf event
loop never blocks. The status is replaced with a server-side JSON Patch (it cannot conflict with
changes to the rest of the job); the pod-serial reservation, a read-modify-write, carries the
resourceVersion it read and is retried on 409 with a fresh read (tenacity: the operator's one
retry mechanism); creates are idempotent (AlreadyExists is success) so that a restarted operator
can repeat them. The job's Service and
token Secret are server-side applied: one request creates a missing one or restores a changed one,
and the operator never reads a Secret.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import logging
from collections.abc import Callable
from typing import Any, TypeVar, cast

import kopf
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from tenacity import AsyncRetrying, RetryError, retry_if_exception, stop_after_attempt

from megatron_contract import wire
from megatron_operator.builders import ANNOTATION_NEXT_SERIAL

log = logging.getLogger(__name__)
T = TypeVar("T")

API_THREADS = 16  # the API client's calls block: they run on these threads, beside the event loop
_executor = concurrent.futures.ThreadPoolExecutor(max_workers=API_THREADS, thread_name_prefix="kube")
_api: client.ApiClient | None = None
CONFLICT_RETRIES = 8
#: The field manager of the operator's server-side applies (the same in every replica and restart).
FIELD_MANAGER = "megatron-operator"
_APPLY: dict[str, Any] = {"field_manager": FIELD_MANAGER, "_content_type": "application/apply-patch+yaml"}


class KubeError(RuntimeError):
    """An API call failed for a reason retrying will not fix."""


class NotServed(KubeError):
    """The API server does not serve that kind of object (its CRD is not installed)."""


class JsonBody(dict[str, Any]):
    """A request body made of JSON types only (str, numbers, bools, None, lists, dicts), as
    ``model_dump(mode="json")`` makes them: sent without the API client's walk over every value,
    which exists to turn its own models and datetimes into JSON types (~17-45 ms of a status write at
    4096 pods, on the path from a failure to its plan stored)."""


class _ApiClient(client.ApiClient):
    def sanitize_for_serialization(self, obj: Any) -> Any:
        if isinstance(obj, JsonBody):
            return obj
        return super().sanitize_for_serialization(obj)


def configure(kubeconfig: str | None = None) -> client.ApiClient:
    """Load credentials (in-cluster, or a kubeconfig) once; returns the shared ApiClient."""
    global _api
    if _api is not None:
        return _api
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config(config_file=kubeconfig)
    cfg = client.Configuration.get_default_copy()
    cfg.connection_pool_maxsize = 32
    _api = _ApiClient(cfg)
    return _api


def _core() -> client.CoreV1Api:
    return client.CoreV1Api(configure())


def _policy() -> client.PolicyV1Api:
    return client.PolicyV1Api(configure())


def _custom() -> client.CustomObjectsApi:
    return client.CustomObjectsApi(configure())


async def _call[T](fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_executor, functools.partial(fn, *args, **kwargs))


async def _send(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Call an API method whose answer the operator does not use: the answer's body is read and
    dropped, not parsed into objects (a created or relabelled pod, thousands at once; a job whose
    status holds a plan of hundreds of kB), and its connection goes back to the pool. A refusal
    still raises ApiException, with the API server's message."""

    def call() -> None:
        answer = fn(*args, _preload_content=False, **kwargs)
        answer.drain_conn()
        answer.release_conn()

    await _call(call)


def _exists_ok(exc: ApiException) -> bool:
    return exc.status == 409


async def create_pod(body: dict[str, Any]) -> bool:
    """Create a pod; False when a pod of that name already exists."""
    try:
        await _send(_core().create_namespaced_pod, body["metadata"]["namespace"], body)
    except ApiException as exc:
        if _exists_ok(exc):
            return False
        raise
    return True


async def delete_pod(namespace: str, name: str, *, force: bool = False) -> None:
    """Delete a pod (gone already is fine); ``force`` skips the grace period."""
    grace = 0 if force else None
    try:
        await _send(_core().delete_namespaced_pod, name, namespace, grace_period_seconds=grace)
    except ApiException as exc:
        if exc.status != 404:
            raise


async def patch_pod_labels(namespace: str, name: str, labels: dict[str, str | None]) -> None:
    """Merge labels into a pod (None removes one); a pod gone meanwhile is ignored."""
    try:
        await _send(_core().patch_namespaced_pod, name, namespace, {"metadata": {"labels": labels}})
    except ApiException as exc:
        if exc.status != 404:
            raise


async def apply_service(body: dict[str, Any]) -> None:
    """Server-side apply the headless Service: created when missing, left as is when it matches."""
    meta = body["metadata"]
    await _call(_core().patch_namespaced_service, meta["name"], meta["namespace"], body, **_APPLY)


async def apply_disruption_budget(body: dict[str, Any]) -> None:
    """Server-side apply the workers' PodDisruptionBudget: created when missing, restored when changed."""
    meta = body["metadata"]
    await _call(_policy().patch_namespaced_pod_disruption_budget, meta["name"], meta["namespace"], body, **_APPLY)


async def apply_secret(body: dict[str, Any]) -> None:
    """Server-side apply the token Secret: created when missing, its token restored when changed.

    One write and no read: the operator holds no read access to Secrets. Not forced, so a Secret of
    that name that someone else manages is refused with a conflict (409) instead of taken over.
    """
    meta = body["metadata"]
    await _call(_core().patch_namespaced_secret, meta["name"], meta["namespace"], body, **_APPLY)


async def create_custom(group: str, version: str, plural: str, body: dict[str, Any]) -> bool:
    """Create a namespaced custom object; False when one of that name exists already.

    Raises:
        NotServed: the API server serves no such kind (404 without a namespace to blame).
    """
    try:
        await _call(
            _custom().create_namespaced_custom_object, group, version, body["metadata"]["namespace"], plural, body
        )
    except ApiException as exc:
        if _exists_ok(exc):
            return False
        if exc.status == 404:
            raise NotServed(f"{plural}.{group}/{version} is not served: {error_message(exc)}") from exc
        raise
    return True


async def delete_custom(group: str, version: str, plural: str, namespace: str, name: str) -> None:
    """Delete a namespaced custom object (gone already is fine)."""
    try:
        await _call(_custom().delete_namespaced_custom_object, group, version, namespace, plural, name)
    except ApiException as exc:
        if exc.status != 404:
            raise


async def get_cluster_custom(group: str, version: str, plural: str, name: str) -> dict[str, Any] | None:
    """A cluster-scoped custom object, or None when there is none."""
    try:
        found = await _call(_custom().get_cluster_custom_object, group, version, plural, name)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return cast(dict[str, Any], found)


async def patch_custom_status(
    group: str, version: str, plural: str, namespace: str, name: str, patch: dict[str, Any]
) -> bool:
    """Merge-patch a namespaced custom object's status; False when the resourceVersion the patch
    carries is stale (409) or the object is gone (404): the caller looks again."""
    try:
        await _call(
            _custom().patch_namespaced_custom_object_status,
            group,
            version,
            namespace,
            plural,
            name,
            patch,
            _content_type="application/merge-patch+json",
        )
    except ApiException as exc:
        if exc.status in (404, 409):
            return False
        raise
    return True


def error_message(exc: BaseException) -> str:
    """A short reason for a failed call: the API server's own message when it sent one."""
    if isinstance(exc, ApiException):
        message = ""
        with contextlib.suppress(ValueError, TypeError):
            message = str(json.loads(exc.body or "{}").get("message") or "")
        return f"{exc.status} {exc.reason}: {message}".strip().rstrip(":") if message else f"{exc.status} {exc.reason}"
    return f"{type(exc).__name__}: {exc}"


async def get_job(namespace: str, name: str) -> dict[str, Any]:
    """The MegatronJob as stored now."""
    job = await _call(_custom().get_namespaced_custom_object, wire.GROUP, wire.VERSION, namespace, wire.PLURAL, name)
    return cast(dict[str, Any], job)


async def write_status(namespace: str, name: str, status: dict[str, Any]) -> None:
    """Replace a job's status whole, in one request.

    A JSON Patch ``add /status`` is applied by the API server to the object as stored, so a
    concurrent change of the job's metadata or spec (a label, an annotation, kopf's bookkeeping)
    never makes it conflict; the status itself has one writer, the leader. No read is needed first,
    which matters when the plan in status is a few hundred kilobytes. ``status`` holds JSON types
    only (:class:`JsonBody`), as ``status.status_body`` makes it.
    """
    await _patch_status(namespace, name, [{"op": "add", "path": "/status", "value": JsonBody(status)}], "json-patch")


async def write_conditions(namespace: str, name: str, conditions: list[dict[str, Any]]) -> None:
    """Replace only ``status.conditions`` (a merge patch): the rest of a status this version cannot
    read stays exactly as the version that wrote it left it."""
    await _patch_status(namespace, name, {"status": {"conditions": conditions}}, "merge-patch")


async def _patch_status(namespace: str, name: str, body: Any, kind: str) -> None:
    """Patch a job's status subresource with a ``kind`` ("json-patch", "merge-patch") body."""
    await _send(
        _custom().patch_namespaced_custom_object_status,
        wire.GROUP,
        wire.VERSION,
        namespace,
        wire.PLURAL,
        name,
        body,
        _content_type=f"application/{kind}+json",
    )


def _is_conflict(exc: BaseException) -> bool:
    return isinstance(exc, ApiException) and exc.status == 409


async def reserve_serials(namespace: str, name: str, count: int, floor: int) -> int:
    """Reserve ``count`` pod serial numbers on the job; returns the first.

    The reservation is written before any pod is created, so a restarted operator never gives two
    pods the same name; ``floor`` (one above the highest serial seen) guards against a lost write.
    A write that conflicts (the job changed since the read) is tried again with a fresh read.
    """

    async def reserve() -> int:
        job = await get_job(namespace, name)
        annotations = job["metadata"].get("annotations") or {}
        start = max(int(annotations.get(ANNOTATION_NEXT_SERIAL, "0")), floor)
        patch = {
            "metadata": {
                "resourceVersion": job["metadata"]["resourceVersion"],
                "annotations": {ANNOTATION_NEXT_SERIAL: str(start + count)},
            }
        }
        await _call(
            _custom().patch_namespaced_custom_object, wire.GROUP, wire.VERSION, namespace, wire.PLURAL, name, patch
        )
        return start

    retrying = AsyncRetrying(
        retry=retry_if_exception(_is_conflict),
        stop=stop_after_attempt(CONFLICT_RETRIES),
        before_sleep=lambda state: log.info(
            "serial reservation on %s/%s conflicted (attempt %d); retrying", namespace, name, state.attempt_number
        ),
    )
    try:
        return await retrying(reserve)
    except RetryError as exc:
        raise KubeError(f"serials of {namespace}/{name}: still conflicting after {CONFLICT_RETRIES} attempts") from exc


def post_event(body: Any, type_: str, reason: str, message: str) -> None:
    """A Kubernetes event on the job (posted in the background by kopf)."""
    try:
        kopf.event(body, type=type_, reason=reason, message=message[:1024])
    except Exception:  # an event is never worth failing a reconcile for
        log.exception("could not post event %s on the job", reason)


# -- leader election (coordination.k8s.io Lease), used before kopf starts --------------------------


def read_lease(namespace: str, name: str, timeout: float | None = None) -> client.V1Lease | None:
    """The Lease, or None when there is none (``timeout``: seconds the request may take)."""
    try:
        lease: client.V1Lease = client.CoordinationV1Api(configure()).read_namespaced_lease(
            name, namespace, _request_timeout=timeout
        )
        return lease
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def create_lease(namespace: str, body: client.V1Lease, timeout: float | None = None) -> bool:
    """Create the Lease; False when someone else created it first."""
    try:
        client.CoordinationV1Api(configure()).create_namespaced_lease(namespace, body, _request_timeout=timeout)
        return True
    except ApiException as exc:
        if exc.status == 409:
            return False
        raise


def replace_lease(namespace: str, name: str, body: client.V1Lease, timeout: float | None = None) -> bool:
    """Replace the Lease at the resourceVersion it carries; False on conflict (someone else wrote)."""
    try:
        client.CoordinationV1Api(configure()).replace_namespaced_lease(name, namespace, body, _request_timeout=timeout)
        return True
    except ApiException as exc:
        if exc.status == 409:
            return False
        raise
