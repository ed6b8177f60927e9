"""The operator's malloc settings, seen in fresh processes through glibc's own accounting.

Scenarios: eight threads allocating at once share two arenas once tuned, and take one each
without (the control); a large block, freed, no longer raises the mmap threshold, so the next
block above the fixed threshold is still mapped (and goes back to the system when freed); a
setting given in the environment is left to glibc.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="the settings are glibc's; this libc is " + repr(platform.libc_ver())
)

PROBE = r"""
import ctypes, json, os, sys, tempfile, threading
from megatron_operator.allocator import tune_allocator

done = tune_allocator() if sys.argv[1] == "tuned" else {}
libc = ctypes.CDLL("libc.so.6")

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = MallInfo2

def mapped_blocks():
    return libc.mallinfo2().hblks

# The mmap threshold: free a 4 MiB block (glibc then raises its threshold to 4 MiB unless fixed),
# and see whether a 1 MiB block is mapped.
big = ctypes.create_string_buffer(4 << 20)
del big
before = mapped_blocks()
mid = ctypes.create_string_buffer(1 << 20)
mapped_after_free = mapped_blocks() - before
del mid

# The arenas: eight threads allocating at once, each alive until all have allocated.
barrier = threading.Barrier(8)
keep = []
def work():
    keep.append(bytearray(64 * 1024))
    barrier.wait()
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
libc.fopen.restype = ctypes.c_void_p
with tempfile.NamedTemporaryFile(suffix=".xml") as f:
    fp = libc.fopen(f.name.encode(), b"w")
    libc.malloc_info(0, ctypes.c_void_p(fp))
    libc.fclose(ctypes.c_void_p(fp))
    heaps = open(f.name).read().count("<heap nr=")
print(json.dumps({"done": done, "heaps": heaps, "mapped_after_free": mapped_after_free}))
"""


def _probe(mode: str, **env: str) -> dict[str, object]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], env={**base, **env}, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout)
    return result


def test_tuned_threads_share_two_arenas_and_large_blocks_stay_mapped() -> None:
    tuned = _probe("tuned")
    assert tuned["done"] == {"MALLOC_ARENA_MAX": 2, "MALLOC_MMAP_THRESHOLD_": 256 * 1024}
    assert tuned["heaps"] == 2, tuned
    assert tuned["mapped_after_free"] == 1, tuned
    # The control: glibc's defaults give threads arenas of their own, and map no 1 MiB block once
    # a 4 MiB one was freed.
    plain = _probe("plain")
    assert plain["done"] == {}
    assert plain["heaps"] > 2, plain  # type: ignore[operator]
    assert plain["mapped_after_free"] == 0, plain


def test_a_setting_from_the_environment_is_left_to_glibc() -> None:
    probe = _probe("tuned", MALLOC_ARENA_MAX="4")
    assert probe["done"] == {"MALLOC_MMAP_THRESHOLD_": 256 * 1024}
    assert 2 < probe["heaps"] <= 4, probe  # type: ignore[operator]
