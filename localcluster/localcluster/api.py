"""A minimal Kubernetes API client over urllib, for the local cluster's own tools.

The node agent needs only get/list/patch/delete and a watch stream, and must not depend on the
(large, often-changing) generated client, so this speaks plain JSON over HTTPS with the admin
certificate of a kubeconfig that names its certificate files (as the local cluster's does).
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml


class ApiError(RuntimeError):
    """A non-success answer from the API server."""

    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f"{status}: {body if isinstance(body, str) else json.dumps(body)[:500]}")
        self.status = status
        self.body = body


class KubeApi:
    """JSON over HTTPS to the server of a kubeconfig whose certificates and key are files."""

    def __init__(self, kubeconfig: Path) -> None:
        config = yaml.safe_load(Path(kubeconfig).read_text())
        ctx_name = config["current-context"]
        ctx = next(c["context"] for c in config["contexts"] if c["name"] == ctx_name)
        cluster = next(c["cluster"] for c in config["clusters"] if c["name"] == ctx["cluster"])
        user = next(u["user"] for u in config["users"] if u["name"] == ctx["user"])
        self.server = cluster["server"]
        wanted = (("certificate-authority", cluster), ("client-certificate", user), ("client-key", user))
        missing = [key for key, entry in wanted if key not in entry]
        if missing:
            names = ", ".join(missing)
            raise ValueError(f"{kubeconfig}: {names} missing (certificate files are needed, not embedded data)")
        self.ssl = ssl.create_default_context(cafile=cluster["certificate-authority"])
        self.ssl.load_cert_chain(user["client-certificate"], user["client-key"])

    def request(self, method: str, path: str, body: Any = None, *, patch: str = "merge", timeout: float = 10) -> Any:
        """Call the API; return the decoded JSON body. Raises ApiError on a non-2xx status."""
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = (
                {"merge": "application/merge-patch+json", "strategic": "application/strategic-merge-patch+json"}[patch]
                if method == "PATCH"
                else "application/json"
            )
        req = urllib.request.Request(self.server + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, context=self.ssl, timeout=timeout) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as err:
            payload = err.read()
            try:
                decoded: Any = json.loads(payload)
            except json.JSONDecodeError:
                decoded = payload.decode(errors="replace")
            raise ApiError(err.code, decoded) from None

    def watch(self, path: str, resource_version: str, timeout_seconds: int = 60) -> Iterator[dict[str, Any]]:
        """Yield watch events of a collection from ``resource_version`` until the server ends the stream."""
        query = urllib.parse.urlencode(
            {
                "watch": "1",
                "resourceVersion": resource_version,
                "allowWatchBookmarks": "true",
                "timeoutSeconds": str(timeout_seconds),
            }
        )
        sep = "&" if "?" in path else "?"
        req = urllib.request.Request(self.server + path + sep + query, headers={"Accept": "application/json"})
        with urllib.request.urlopen(req, context=self.ssl, timeout=timeout_seconds + 10) as resp:
            for line in resp:
                if line.strip():
                    yield json.loads(line)
