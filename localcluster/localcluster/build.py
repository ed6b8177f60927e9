"""Build the pinned control-plane binaries from their Go modules, once, into a cache.

Each component is built in a scratch Go module outside the clone. kube-apiserver and friends
live in ``k8s.io/kubernetes``, whose go.mod points its staging modules (``k8s.io/api``, ...) at
``./staging``; module zips leave those out, so the scratch module pins each one to its published
``v0.X.Y`` with ``replace`` lines.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ENV_CACHE_DIR = "MEGATRON_OPERATOR_CACHE"

KUBERNETES_VERSION = "v1.33.13"
ETCD_VERSION = "v3.5.35"
KWOK_VERSION = "v0.7.0"
HELM_VERSION = "v3.21.4"
HELM_DOCS_VERSION = "v1.14.2"
#: Prometheus 3.16.0 (its Go module numbers releases v0.3MM.P for 3.MM.P).
PROMETHEUS_VERSION = "v0.316.0"
#: Kueue's controller manager (localcluster/kueue.py); its CRDs come from the same module.
KUEUE_VERSION = "v0.15.2"

#: Staging modules of k8s.io/kubernetes v1.33, each published as k8s.io/NAME v0.33.x.
_STAGING_MODULES = [
    "api",
    "apiextensions-apiserver",
    "apimachinery",
    "apiserver",
    "cli-runtime",
    "client-go",
    "cloud-provider",
    "cluster-bootstrap",
    "code-generator",
    "component-base",
    "component-helpers",
    "controller-manager",
    "cri-api",
    "cri-client",
    "csi-translation-lib",
    "dynamic-resource-allocation",
    "endpointslice",
    "externaljwt",
    "kms",
    "kube-aggregator",
    "kube-controller-manager",
    "kube-proxy",
    "kube-scheduler",
    "kubectl",
    "kubelet",
    "metrics",
    "mount-utils",
    "pod-security-admission",
    "sample-apiserver",
    "sample-cli-plugin",
    "sample-controller",
]


class BuildError(RuntimeError):
    """A component could not be built; the message carries the tail of the Go output."""


@dataclasses.dataclass(frozen=True)
class Component:
    """One binary: where its main package lives and which module pins it."""

    name: str
    module: str
    version: str
    package: str
    #: Go build tags. A component built with tags skips ``go mod tidy``, which resolves the
    #: modules of every tag combination, including code the tags leave out.
    tags: tuple[str, ...] = ()
    #: A folder of the module's source kept next to the binary (``files_path``), e.g. CRDs that
    #: must match the binary's version.
    module_files: str | None = None

    def ldflags(self) -> str:
        """Strip symbols; stamp k8s binaries with their version (a module build leaves v0.0.0,
        which breaks the compatibility-version checks of 1.31+ components)."""
        flags = ["-s", "-w"]
        if self.module == "k8s.io/kubernetes":
            major, minor = self.version.removeprefix("v").split(".")[:2]
            for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
                flags += [
                    f"-X {pkg}.gitVersion={self.version}",
                    f"-X {pkg}.gitMajor={major}",
                    f"-X {pkg}.gitMinor={minor}",
                    f"-X {pkg}.gitTreeState=clean",
                ]
        if self.module == "github.com/prometheus/prometheus":
            major_minor_patch = self.version.removeprefix("v0.")
            release = f"{int(major_minor_patch[0])}.{int(major_minor_patch[1:3])}.{major_minor_patch.split('.')[1]}"
            flags.append(f"-X github.com/prometheus/common/version.Version={release}")
        return " ".join(flags)

    def go_mod(self) -> str:
        lines = [f"module scratch/{self.name}", "", "go 1.24.0", "", f"require {self.module} {self.version}"]
        if self.module == "k8s.io/kubernetes":
            staging_version = "v0." + self.version.removeprefix("v1.")
            lines.append("")
            lines += [f"replace k8s.io/{m} => k8s.io/{m} {staging_version}" for m in _STAGING_MODULES]
        return "\n".join(lines) + "\n"


def _k8s(name: str) -> Component:
    return Component(name, "k8s.io/kubernetes", KUBERNETES_VERSION, f"k8s.io/kubernetes/cmd/{name}")


CONTROL_PLANE = (
    Component("etcd", "go.etcd.io/etcd/server/v3", ETCD_VERSION, "go.etcd.io/etcd/server/v3"),
    _k8s("kube-apiserver"),
    _k8s("kube-scheduler"),
    _k8s("kube-controller-manager"),
)
KWOK = Component("kwok", "sigs.k8s.io/kwok", KWOK_VERSION, "sigs.k8s.io/kwok/cmd/kwok")
HELM = Component("helm", "helm.sh/helm/v3", HELM_VERSION, "helm.sh/helm/v3/cmd/helm")
# Generates the chart's values table in docs/configuration.md (localcluster/chart_docs.py).
HELM_DOCS = Component(
    "helm-docs", "github.com/norwoodj/helm-docs", HELM_DOCS_VERSION, "github.com/norwoodj/helm-docs/cmd/helm-docs"
)
# The local cluster's Prometheus and promtool (localcluster/prometheus.py): service discovery for
# Kubernetes only, as the other mechanisms pull in dozens of cloud SDKs (and one module the proxy lacks).
_PROMETHEUS_TAGS = ("remove_all_sd", "enable_kubernetes_sd")
PROMETHEUS = Component(
    "prometheus",
    "github.com/prometheus/prometheus",
    PROMETHEUS_VERSION,
    "github.com/prometheus/prometheus/cmd/prometheus",
    _PROMETHEUS_TAGS,
)
PROMTOOL = Component(
    "promtool",
    "github.com/prometheus/prometheus",
    PROMETHEUS_VERSION,
    "github.com/prometheus/prometheus/cmd/promtool",
    _PROMETHEUS_TAGS,
)
# Kueue's manager, for jobs queued through Kueue (localcluster/kueue.py).
KUEUE = Component(
    "kueue",
    "sigs.k8s.io/kueue",
    KUEUE_VERSION,
    "sigs.k8s.io/kueue/cmd/kueue",
    module_files="config/components/crd/bases",
)
ALL = {c.name: c for c in (*CONTROL_PLANE, KWOK, HELM, HELM_DOCS, PROMETHEUS, PROMTOOL, KUEUE)}


def cache_dir() -> Path:
    """The cache root, outside the clone: ``$MEGATRON_OPERATOR_CACHE`` or ``~/.cache/megatron-operator``."""
    return Path(os.environ.get(ENV_CACHE_DIR) or Path.home() / ".cache" / "megatron-operator")


def binary_path(component: Component) -> Path:
    return cache_dir() / "bin" / f"{component.name}-{component.version}"


def files_path(component: Component) -> Path:
    """Where ``component.module_files`` is kept (a copy out of the module cache, which may be cleaned)."""
    return cache_dir() / "share" / f"{component.name}-{component.version}"


def _log(msg: str) -> None:
    print(f"[localcluster] {msg}", file=sys.stderr, flush=True)


def build(component: Component) -> Path:
    """Return the cached binary for ``component``, building it first if needed.

    Raises:
        BuildError: ``go`` is missing or the build failed.
    """
    target = binary_path(component)
    files_missing = component.module_files is not None and not files_path(component).exists()
    if target.exists() and not files_missing:
        return target
    go = shutil.which("go")
    if go is None:
        raise BuildError("the Go toolchain ('go') is not on PATH; it is needed once to build " + component.name)
    work = cache_dir() / "gomod" / f"{component.name}-{component.version}"
    env = {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-mod=mod", "GOTOOLCHAIN": "local"}
    if target.exists():  # the binary is there, the module's files are not (an older cache)
        _copy_module_files(go, component, work, env)
        return target
    work.mkdir(parents=True, exist_ok=True)
    (work / "go.mod").write_text(component.go_mod())
    (work / "tools.go").write_text(f'//go:build tools\n\npackage tools\n\nimport _ "{component.package}"\n')
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    compile_cmd = [go, "build", "-trimpath", f"-ldflags={component.ldflags()}", "-o", str(partial)]
    if component.tags:
        compile_cmd.append("-tags=" + ",".join(component.tags))
    steps = [("compiling", [*compile_cmd, component.package])]
    if not component.tags:
        steps.insert(0, ("resolving modules", [go, "mod", "tidy"]))
    for what, cmd in steps:
        _log(f"{component.name} {component.version}: {what} (first run only; minutes on 2 cores)")
        _run_with_progress(cmd, work, env, component.name)
    if component.module_files is not None:
        _copy_module_files(go, component, work, env)
    partial.rename(target)
    _log(f"{component.name}: built {target}")
    return target


def _copy_module_files(go: str, component: Component, work: Path, env: dict[str, str]) -> None:
    """Copy ``component.module_files`` out of the module (downloaded again if the cache was cleaned)."""
    assert component.module_files is not None
    proc = subprocess.run(
        [go, "mod", "download", "-json", f"{component.module}@{component.version}"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise BuildError(f"downloading {component.module}@{component.version} failed:\n{proc.stdout}{proc.stderr}")
    source = Path(json.loads(proc.stdout)["Dir"]) / component.module_files
    dest = files_path(component)
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(source, partial)
    for f in partial.rglob("*"):
        f.chmod(0o644 if f.is_file() else 0o755)  # the module cache's files are read-only
    partial.rename(dest)


def _run_with_progress(cmd: list[str], cwd: Path, env: dict[str, str], name: str) -> None:
    start = time.monotonic()
    done = threading.Event()

    def tick() -> None:
        while not done.wait(30):
            _log(f"{name}: still building ({time.monotonic() - start:.0f} s)")

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    finally:
        done.set()
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise BuildError(f"building {name} failed ({' '.join(cmd[:3])} exited {proc.returncode}):\n{tail}")


def build_all(names: list[str] | None = None) -> dict[str, Path]:
    """Build (or find cached) every named component; all of them (control plane, kwok, helm, helm-docs,
    prometheus, promtool, kueue) by default."""
    unknown = sorted(set(names or ()) - set(ALL))
    if unknown:
        raise BuildError(f"unknown component(s) {', '.join(unknown)}; known: {', '.join(ALL)}")
    chosen = [ALL[n] for n in names] if names else list(ALL.values())
    return {c.name: build(c) for c in chosen}


if __name__ == "__main__":
    try:
        for name, path in build_all(sys.argv[1:] or None).items():
            print(f"{name}\t{path}")
    except BuildError as err:
        _log(str(err))
        sys.exit(1)
