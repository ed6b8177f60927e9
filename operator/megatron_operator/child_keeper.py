"""The job's children as API calls: the token Secret, the Service, the workers' PodDisruptionBudget
and the pods, created, relabelled and deleted for one job's controller.

:mod:`children` decides (backoffs, failed starts, the ``CreateFailed`` verdict) without a clock or
the API; this module carries those decisions out and remembers what it did: pods on their way
(``expected``), surplus pods it deleted (``retired``, not failures), when each child was last
applied. It never raises for a refused call: every kind of child backs off instead, and
:meth:`ChildKeeper.create_failed` says when the job's condition must change.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from megatron_contract import wire
from megatron_contract.job import ConditionType, MegatronJobSpec, MegatronJobStatus
from megatron_contract.mesh import MeshPlan, PlanReason
from megatron_operator import builders, kube, planner, queueing
from megatron_operator.builders import JobRef
from megatron_operator.children import Backoff, Child, LabelRequests, StartTracker, verdict
from megatron_operator.failures import Failure, PodFacts
from megatron_operator.heartbeats import HeartbeatBook
from megatron_operator.per_plan import PerPlan
from megatron_operator.queueing import Gate
from megatron_operator.settings import OperatorSettings
from megatron_operator.status import Reason, condition

log = logging.getLogger(__name__)

EXPECTED_POD_SECONDS = 120.0  # a created pod not seen in the index by then is created again
#: Pod creates under way at once: twice the API client's threads, so that none waits for work.
CREATES_IN_FLIGHT = 2 * kube.API_THREADS
#: A pod waiting for this reason cannot read its env: the token Secret is likely gone.
SECRET_MISSING_WAIT = "CreateContainerConfigError"
#: Least time between two applies of the Secret prompted by pods (not by the periodic check).
SECRET_PROMPT_SECONDS = 2.0

#: The reason of the CreateFailed condition and event when a kind of child cannot be applied.
_FAILED_CREATE = {
    Child.SECRET: Reason.FAILED_CREATE_SECRET,
    Child.SERVICE: Reason.FAILED_CREATE_SERVICE,
    Child.DISRUPTION_BUDGET: Reason.FAILED_CREATE_DISRUPTION_BUDGET,
}


class ChildKeeper:
    """Creates, applies, relabels and deletes one job's children, backing off per kind of child."""

    def __init__(
        self,
        job: JobRef,
        settings: OperatorSettings,
        book: HeartbeatBook,
        nodes: Callable[[], dict[str, str]],
        spec_of: Callable[[], MegatronJobSpec],
        token_of: Callable[[], str | None],
    ) -> None:
        self.job = job
        self.settings = settings
        self.book = book
        self.nodes = nodes
        self.spec_of = spec_of  # read when the budget is applied: it counts spec.replicas
        self.token_of = token_of
        self.expected: dict[str, float] = {}  # pods created and not yet in the index -> until when
        self.retired: set[str] = set()  # surplus pods this operator deleted (not failures)
        # Each member's data-parallel replica: made once per plan (every pass asks; thousands of members).
        self._replica_of: PerPlan[None, dict[str, int]] = PerPlan(_replicas, size=1)
        self.labels = LabelRequests()
        self._relabelling: set[asyncio.Task[None]] = set()  # patches sent beside the passes
        self.backoffs = {kind: Backoff() for kind in Child}
        self.starts = StartTracker()
        self.due = True  # set by the Service watch when the job's Service is deleted
        self._checked = -float("inf")
        self._secret_applied = -float("inf")
        self._generation: int | None = None
        # Reasons of CreateFailed that a success in this process has answered: a condition read back
        # after a restart is cleared only by a success, not by a fresh process's empty backoffs.
        self._resolved: set[str] = set()

    def _log(self, message: str, *args: object) -> None:
        log.warning("%s/%s: " + message, self.job.namespace, self.job.name, *args)

    def retry_delays(self, now: float) -> list[float]:
        """Seconds until each child that failed may be tried again."""
        return [b.next_at - now for b in self.backoffs.values() if b.failures and b.next_at > now]

    # -- pods --------------------------------------------------------------------------------------

    async def retire(self, names: Sequence[str]) -> None:
        """Delete healthy pods the job no longer needs (not failures)."""
        self.retired.update(names)
        # The label first: an operator restarted before the pods are gone still knows them.
        await asyncio.gather(
            *(
                kube.patch_pod_labels(self.job.namespace, name, builders.role_labels(wire.ROLE_RETIRED, None))
                for name in names
            )
        )
        await self.delete((name, False) for name in names)

    async def delete(self, doomed: Iterable[tuple[str, bool]]) -> None:
        """Delete pods (name, force)."""
        await asyncio.gather(*(kube.delete_pod(self.job.namespace, name, force=force) for name, force in doomed))

    async def create(
        self,
        spec: MegatronJobSpec,
        workers: int,
        spares: int,
        pods: list[PodFacts],
        failed: Mapping[str, Failure],
        generation: int | None,
        gate: Gate | None,
        first_mesh: bool = False,
    ) -> list[str]:
        """Create what is missing: the Secret and Service when due, then ``workers + spares`` pods.

        ``first_mesh``: the job has no plan yet. Its first plan takes the running workers in the
        order of their serials, so workers created before any other carry the replica label that
        plan gives them from the start: relabelled after it instead, the 4096 pods of a large job
        were 4096 patches, and as many pod events for the operator to read, in the seconds after
        its first plan (a pod's failure then waited behind them).

        Every kind of child backs off after failures (children.py): pods that keep failing at start,
        or creates the API server refuses, never make a tight loop; after a few failures in a row
        :meth:`create_failed` says why. No pod is created while the token Secret cannot be: it could
        not start without it.
        """
        count = workers + spares
        now = time.monotonic()
        if generation != self._generation:  # an edited spec may have fixed what failed
            self._generation = generation
            self.backoffs[Child.POD].succeeded()
            self.due = True  # and the budget counts the workers of spec.replicas
        await self.ensure(pods, pods_wanted=count > 0)
        self._settle_starts(pods, failed, now)
        if count > 0 and self.backoffs[Child.POD].ready(now) and not self.backoffs[Child.SECRET].failures:
            first = first_mesh and not any(p.role == wire.ROLE_WORKER for p in pods)
            return await self._create_pods(spec, workers, spares, pods, gate, first)
        return []

    async def _create_pods(
        self,
        spec: MegatronJobSpec,
        workers: int,
        spares: int,
        pods: list[PodFacts],
        gate: Gate | None,
        first_workers: bool = False,
    ) -> list[str]:
        """Reserve serials and create the pods; a refused create counts as a failure of the pod backoff."""
        count = workers + spares
        now = time.monotonic()
        backoff = self.backoffs[Child.POD]
        floor = max([p.serial for p in pods] + [-1]) + 1
        try:
            start = await kube.reserve_serials(self.job.namespace, self.job.name, count, floor)
        except Exception as exc:  # any refusal is reported the same way, then retried
            backoff.failed(now, Reason.FAILED_CREATE_POD, f"reserving pod names on the job: {kube.error_message(exc)}")
            self._log("%s", backoff.error)
            return []
        roles = [wire.ROLE_WORKER if i < workers else wire.ROLE_SPARE for i in range(count)]
        names = [builders.pod_name(self.job, start + i) for i in range(count)]
        deadline = now + EXPECTED_POD_SECONDS
        for name in names:
            self.expected[name] = deadline
        # Each body is built when its create is sent: built all at once, 4096 pods' manifests
        # (~30 MiB) waited in the API client's queue, and the operator's memory kept the peak.
        sending = asyncio.Semaphore(CREATES_IN_FLIGHT)

        def replica(i: int) -> int | None:
            return planner.first_plan_replica(spec, i) if first_workers and i < workers else None

        async def create(i: int, role: str) -> bool:
            async with sending:
                body = builders.build_pod(
                    self.job, spec, serial=start + i, role=role, operator_url=self.settings.url, replica=replica(i)
                )
                if gate is not None:  # where Kueue admitted the job: its flavors' nodes
                    body = queueing.with_node_selector(body, gate.node_selector(role))
                return await kube.create_pod(body)

        results = await asyncio.gather(*(create(i, role) for i, role in enumerate(roles)), return_exceptions=True)
        created: list[str] = []
        refused: list[str] = []
        for name, result in zip(names, results, strict=True):
            if isinstance(result, asyncio.CancelledError):
                raise result
            if isinstance(result, BaseException):
                self.expected.pop(name, None)  # not coming: assess must ask for it again
                refused.append(f"creating pod {name}: {kube.error_message(result)}")
            else:
                created.append(name)
        self.starts.created(created, now)
        if refused:
            backoff.failed(now, Reason.FAILED_CREATE_POD, "; ".join(refused[:3])[:2000])
            self._log("%d of %d pod creates refused: %s", len(refused), count, refused[0])
        else:
            self._resolved.add(Reason.FAILED_CREATE_POD)
            if backoff.reason == Reason.FAILED_CREATE_POD:
                backoff.succeeded()  # the API server takes our pods again (a failed start is judged later)
        return created

    def _settle_starts(self, pods: list[PodFacts], failed: Mapping[str, Failure], now: float) -> None:
        """Pods created here that failed soon count against the pod backoff; one that started resets it."""
        reported = {p.name for p in pods if self.book.last(self.job.uid, p.name) is not None}
        outcome = self.starts.observe(pods, failed, self.retired, self.nodes(), now, reported)
        backoff = self.backoffs[Child.POD]
        if outcome.started:
            backoff.succeeded()
            self._resolved.update((Reason.FAILED_CREATE_POD, Reason.PODS_FAIL_AT_START))
        for message in outcome.messages:
            backoff.failed(now, Reason.PODS_FAIL_AT_START, message)
        if outcome.failed and backoff.failures > 1:
            self._log(
                "%d created pods in a row failed at start; next create in %.1f s (%s)",
                backoff.failures,
                max(0.0, backoff.next_at - now),
                outcome.messages[-1],
            )

    async def sync_labels(
        self, plan: MeshPlan, pods: list[PodFacts], committed_epoch: int, failed: Mapping[str, Failure]
    ) -> None:
        """Role and replica labels follow the plan in force."""
        if plan.reason is PlanReason.MIGRATE and committed_epoch < plan.epoch:
            # Until the new mesh trains, the leaving members train on up to the plan's step
            # boundary: their worker label keeps them under the PodDisruptionBudget, or a drain's
            # eviction would kill one mid-way (a step its peers commit and it does not).
            return
        replica_of = self._replica_of(plan, None)
        now = time.monotonic()
        patches: list[tuple[str, dict[str, str | None]]] = []
        for p in pods:
            if p.deleting or p.name in failed or p.name in self.retired or p.role == wire.ROLE_RETIRED:
                continue
            role = wire.ROLE_WORKER if p.name in replica_of else wire.ROLE_SPARE
            replica = str(replica_of[p.name]) if p.name in replica_of else None
            labels = builders.role_labels(role, replica_of.get(p.name))
            if self.labels.due(p.name, labels, p.role == role and p.replica == replica, now):
                patches.append((p.name, labels))
        if self.labels.pending():
            self.labels.keep_only({p.name for p in pods})
        if patches:
            # Beside the passes, not in them: a new mesh can relabel thousands of pods (every
            # replica label after a shrink); the first plan of a 1,024-pod job took a pass ~7 s
            # of patches, during which it could act on no other failure.
            task = asyncio.create_task(self._relabel_all(patches))
            self._relabelling.add(task)
            task.add_done_callback(self._relabelling.discard)

    async def _relabel_all(self, patches: list[tuple[str, dict[str, str | None]]]) -> None:
        errors = await asyncio.gather(*(self._relabel(name, labels) for name, labels in patches))
        failed = [error for error in errors if error is not None]
        if failed:  # asked again once LABEL_RESEND_SECONDS have passed
            self._log("could not relabel %d of %d pods; first: %s", len(failed), len(patches), failed[0])

    async def _relabel(self, name: str, labels: dict[str, str | None]) -> str | None:
        if name in self.retired:  # retired by a pass since this one asked: its label says so
            return None
        try:
            await kube.patch_pod_labels(self.job.namespace, name, labels)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return f"{name}: {kube.error_message(exc)}"
        return None

    async def close(self) -> None:
        """Stop the label patches still on their way (the job is gone, or this operator stops)."""
        for task in list(self._relabelling):
            task.cancel()
        await asyncio.gather(*self._relabelling, return_exceptions=True)

    # -- Secret, Service, budget -------------------------------------------------------------------

    async def ensure(self, pods: list[PodFacts], *, pods_wanted: bool) -> None:
        """Apply the token Secret, the Service and the workers' PodDisruptionBudget when due; never
        raises (failures back off instead).

        The Service and the budget are applied when the watch saw them deleted and periodically; the
        Secret (which the operator may not watch) periodically, before pods are created, and when a
        pod cannot start for want of it. An apply of an unchanged child changes nothing.
        """
        now = time.monotonic()
        periodic = now - self._checked >= self.settings.children_check_seconds
        if periodic:
            self._checked = now
        # Pods stuck for want of the Secret prompt an apply on every pass: throttled.
        stuck = any(p.waiting == SECRET_MISSING_WAIT for p in pods)
        wanted = {
            Child.SECRET: periodic
            or self.due
            or pods_wanted
            or (stuck and now - self._secret_applied >= SECRET_PROMPT_SECONDS),
            Child.SERVICE: periodic or self.due,
            Child.DISRUPTION_BUDGET: self.settings.disruption_budgets and (periodic or self.due),
        }
        self.due = False
        apply = {
            Child.SECRET: self._apply_secret,
            Child.SERVICE: self._apply_service,
            Child.DISRUPTION_BUDGET: self._apply_disruption_budget,
        }
        if not self.settings.disruption_budgets:
            del apply[Child.DISRUPTION_BUDGET]
        go = [k for k in apply if (wanted[k] or self.backoffs[k].failures) and self.backoffs[k].ready(now)]
        if not go:
            return
        results = await asyncio.gather(*(apply[kind]() for kind in go), return_exceptions=True)
        for kind, result in zip(go, results, strict=True):
            if isinstance(result, asyncio.CancelledError):
                raise result
            backoff = self.backoffs[kind]
            if isinstance(result, BaseException):
                backoff.failed(now, _FAILED_CREATE[kind], f"applying {kind.value}: {kube.error_message(result)}")
                self._log("%s (failure %d in a row)", backoff.error, backoff.failures)
            else:
                backoff.succeeded()
                self._resolved.add(_FAILED_CREATE[kind])

    async def _apply_secret(self) -> None:
        token = self.token_of()
        if token is None:
            raise RuntimeError("the operator has no token key, so the job has no token")
        await kube.apply_secret(builders.build_secret(self.job, token))
        self._secret_applied = time.monotonic()

    async def _apply_service(self) -> None:
        await kube.apply_service(builders.build_service(self.job))

    async def _apply_disruption_budget(self) -> None:
        await kube.apply_disruption_budget(builders.build_disruption_budget(self.job, self.spec_of()))

    # -- what to tell the user ---------------------------------------------------------------------

    def create_failed(self, status: MegatronJobStatus) -> tuple[bool, str, str] | None:
        """The ``CreateFailed`` condition to write (failing, reason, message), or None when the one
        in ``status`` still holds."""
        v = verdict(self.backoffs, Reason.CHILDREN_CREATED)
        old = condition(status, ConditionType.CREATE_FAILED)
        if not v.failing and (old is None or old.status == "False" or old.reason not in self._resolved):
            return None
        if (
            v.failing
            and old is not None
            and old.status == "True"
            and (old.reason, old.message) == (v.reason, v.message)
        ):
            return None
        return v.failing, v.reason, v.message


def _replicas(plan: MeshPlan, _: None) -> dict[str, int]:
    return {m.pod: plan.sizes.coords_of(m.ranks[0]).dp for m in plan.members}
