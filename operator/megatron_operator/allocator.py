"""The C allocator's settings for the operator's process: few malloc arenas, large blocks mapped.

glibc gives each new thread a malloc arena of its own, up to 8 per CPU core. The operator's threads
(the API calls' pool, kopf's executor, the push processes' pool) each fill one during a burst (4096
pods created, or relabelled for a job's first plan) and keep its freed pages. Two arenas bound that
(at 4096 pods on a 16-core host, peak RSS 339 MiB against 353-387 MiB, one run); the threads'
allocations are short, and the GIL serialises most of them anyway.

glibc also raises its mmap threshold to the largest block freed so far (up to 32 MiB), after which a
plan's large JSON buffers come from the arenas and fragment them; a fixed threshold keeps blocks of
``MMAP_THRESHOLD_BYTES`` and more mapped, so each goes back to the system when freed.

A setting given in the environment (``MALLOC_ARENA_MAX``, ``MALLOC_MMAP_THRESHOLD_``, read by glibc
itself) is left as it is. Elsewhere than glibc, nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

ARENA_MAX = 2
MMAP_THRESHOLD_BYTES = 256 * 1024

_M_MMAP_THRESHOLD = -3  # glibc's malloc.h
_M_ARENA_MAX = -8


def tune_allocator() -> dict[str, int]:
    """Bound the malloc arenas and fix the mmap threshold (before the process starts threads);
    returns what was set, by glibc's environment name."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return {}  # not glibc (musl, macOS): its own allocator, its own habits
    done = {}
    for env, param, value in (
        ("MALLOC_ARENA_MAX", _M_ARENA_MAX, ARENA_MAX),
        ("MALLOC_MMAP_THRESHOLD_", _M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
    ):
        if env in os.environ:
            continue
        if mallopt(ctypes.c_int(param), ctypes.c_int(value)) == 1:
            done[env] = value
        else:
            log.warning("mallopt(%s=%d) refused; the allocator keeps its default", env, value)
    return done
