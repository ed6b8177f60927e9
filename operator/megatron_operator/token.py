"""Each job's bearer token, derived from the job's UID under a key only the operator holds.

The token is never stored anywhere the operator has to read back: a restarted operator (or a
standby that takes over) derives the same token again, and a deleted token Secret is recreated
with the same value, so the pods that already run keep their token and new pods get the same one.
The operator therefore needs no read access to Secrets at all.

The key comes from a file (the chart mounts a Secret of the operator's own namespace there); it
must hold at least :data:`MIN_KEY_BYTES` bytes. Rotating the key changes every job's token while
the pods that run hold the old one: rotate it only with no job running.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from pathlib import Path

#: A 256-bit HMAC-SHA256 key; shorter keys are refused.
MIN_KEY_BYTES = 32
#: Domain separation: a key used for anything else never yields a job token by accident.
_CONTEXT = b"megatron.dev/job-token/v1\x00"


class TokenKeyError(RuntimeError):
    """The operator's token key is missing or unusable."""


def read_key(path: Path) -> bytes:
    """The key in ``path``, surrounding whitespace stripped (files written by hand end in a newline).

    Raises:
        TokenKeyError: the file cannot be read or holds fewer than :data:`MIN_KEY_BYTES` bytes.
    """
    try:
        key = path.read_bytes().strip()
    except OSError as exc:
        raise TokenKeyError(f"cannot read the token key file {path}: {exc}") from exc
    if len(key) < MIN_KEY_BYTES:
        raise TokenKeyError(f"the token key in {path} has {len(key)} bytes; at least {MIN_KEY_BYTES} are needed")
    return key


def derive_token(key: bytes, job_uid: str) -> str:
    """The bearer token of the job with UID ``job_uid``: URL-safe base64 of HMAC-SHA256 (43 chars)."""
    if not job_uid:
        raise ValueError("a job token needs the job's UID")
    digest = hmac.new(key, _CONTEXT + job_uid.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
