"""Where each failure's time went, from the operator's log joined to the benchmark's clock.

``operator_recovery.py`` knows when it deleted each pod and when its watch saw the next plan; the
operator's log line for that plan says what woke its pass, how long before, and how long reading
the reports, the assessment and the status write took, and its push's line how long the push took.
Joined by wall-clock time (one host, one clock), they split each failure into:

- ``delete_ms``: the API server answered the delete;
- ``wake_lag_ms``: the delete → the operator's controller woken (its pod event handled);
- ``woken_ms``: the wake-up call → the pass beginning (``behind``: a pass was still running);
- ``read_ms`` / ``assess_ms`` / ``write_ms``: the pass's parts, as the plan's line says;
- ``push_ms``: the push to every member (its own line);
- ``watch_lag_ms``: the status written → the benchmark's watch seeing it (the remainder; a few ms
  below zero when the watch saw the status before the operator, answered, logged its line).

and list the garbage collections the operator logged (``gc_pauses.py``, 50 ms or more), with those
that fell inside a failure's window (delete → pushed): each such collection held that plan.

Run by ``operator_recovery.py`` after each size; on its own, it splits a run again:

    python benchmarks/failure_split.py results.json [operator.log]
"""

from __future__ import annotations

import json
import re
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

_STAMP = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})"
_PLAN = re.compile(
    _STAMP + r" INFO \S+: (?P<job>\S+): plan epoch (?P<epoch>\d+) stored .*?; "
    r"(?:woken by (?P<why>.+?) (?P<woken>[\d.]+) ms before(?P<behind> \(behind a pass)?.*?|on its timer), "
    r"reports read (?P<read>[\d.]+) ms, assess (?P<assess>[\d.]+) ms, status write (?P<write>[\d.]+) ms"
)
_PUSH = re.compile(_STAMP + r" INFO \S+: (?P<job>\S+): pushed epoch (?P<epoch>\d+) to \d+ members in (?P<ms>[\d.]+) ms")
_GC = re.compile(
    _STAMP + r" WARNING \S+: garbage collection of generation (?P<gen>\d) stopped the operator for "
    r"(?P<ms>\d+) ms \((?P<freed>\d+) objects freed\)"
)

#: Above this, a failure's wake-up counts as late in the printed summary.
LATE_WAKE_MS = 40.0


def _unix(stamp: str) -> float:
    """A log line's time (the operator's local time, as ``logging`` writes it) as Unix seconds."""
    return time.mktime(datetime.strptime(stamp[:19], "%Y-%m-%d %H:%M:%S").timetuple()) + int(stamp[20:]) / 1000


def _deleted(failure: dict[str, Any], plan_stamp: str) -> float:
    """When the failure's delete was sent (Unix seconds). Results from before ``deleted_at_unix``
    have the time of day only: the plan's line gives the date."""
    if "deleted_at_unix" in failure:
        return float(failure["deleted_at_unix"])
    hms, _, millis = failure["deleted_at"].partition(".")
    return _unix(f"{plan_stamp[:10]} {hms},{millis or '000'}")


def split_failures(timeline: list[dict[str, Any]], log: str, job: str) -> list[dict[str, Any]]:
    """Each failure of ``timeline`` (``operator_recovery.py``'s) split into its parts; a failure whose
    plan has no line in ``log`` (``job``'s, ``namespace/name``) is left out."""
    plans = {int(m["epoch"]): m for m in _PLAN.finditer(log) if m["job"] == job}
    pushes = {int(m["epoch"]): float(m["ms"]) for m in _PUSH.finditer(log) if m["job"] == job}
    rows = []
    for failure in timeline:
        plan = plans.get(failure["epoch"])
        if plan is None:
            continue
        deleted, stored_at = _deleted(failure, plan[1]), _unix(plan[1])
        read, assess, write = float(plan["read"]), float(plan["assess"]), float(plan["write"])
        began = stored_at - (read + assess + write) / 1000
        woken = float(plan["woken"]) if plan["woken"] else None
        rows.append(
            {
                "epoch": failure["epoch"],
                "measured": failure["measured"],
                "stored_ms": failure["stored_ms"],
                "pushed_ms": failure["pushed_ms"],
                "delete_ms": failure["delete_answered_ms"],
                # On its timer: the pass's own start stands for the wake-up.
                "wake_lag_ms": round((began - (woken or 0) / 1000 - deleted) * 1000, 1),
                "woken_ms": woken,
                "woken_by": plan["why"],
                "behind": bool(plan["behind"]),
                "read_ms": read,
                "assess_ms": assess,
                "write_ms": write,
                "push_ms": pushes.get(failure["epoch"]),
                "watch_lag_ms": round(failure["stored_ms"] - (stored_at - deleted) * 1000, 1),
            }
        )
    return rows


def long_collections(log: str, timeline: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every collection the operator logged, with the failure (its epoch) whose window it fell in."""
    first = re.search(_STAMP, log)
    day = first[1] if first else "1970-01-01 00:00:00,000"
    windows = [(start := _deleted(f, day), start + f["pushed_ms"] / 1000, f["epoch"]) for f in timeline]
    found = []
    for m in _GC.finditer(log):
        ended, ms = _unix(m[1]), int(m["ms"])
        began = ended - ms / 1000
        inside = next((epoch for start, end, epoch in windows if began < end and ended > start), None)
        found.append(
            {"at": m[1], "generation": int(m["gen"]), "ms": ms, "freed": int(m["freed"]), "in_failure_epoch": inside}
        )
    return found


def format_split(rows: list[dict[str, Any]], collections: list[dict[str, Any]]) -> str:
    """The split as a table (all times in ms), then what was late and the collections in windows."""
    lines = [
        " ep stored pushed | delete wake-lag woken read assess write | push | watch-lag",
    ]

    def ms(value: float | None, width: int) -> str:
        return f"{value:{width}.0f}" if value is not None else " " * (width - 1) + "-"

    for r in rows:
        lines.append(
            f"{r['epoch']:3d} {r['stored_ms']:6.0f} {r['pushed_ms']:6.0f} | {r['delete_ms']:6.0f} "
            f"{r['wake_lag_ms']:8.0f} {ms(r['woken_ms'], 5)}{'B' if r['behind'] else ' '}{r['read_ms']:4.0f} "
            f"{r['assess_ms']:6.0f} {r['write_ms']:5.0f} | {ms(r['push_ms'], 4)} | {r['watch_lag_ms']:5.0f}"
        )
    late = [r["wake_lag_ms"] for r in rows if r["wake_lag_ms"] > LATE_WAKE_MS]
    lines.append(
        f"woken more than {LATE_WAKE_MS:.0f} ms after the delete: {len(late)} of {len(rows)} failures"
        + (f" ({', '.join(f'{v:.0f}' for v in late)} ms)" if late else "")
    )
    held = [c for c in collections if c["in_failure_epoch"] is not None]
    lines.append(
        f"garbage collections of 50 ms or more: {len(collections)} in the run, {len(held)} inside a failure's window"
        + "".join(f"; epoch {c['in_failure_epoch']}: generation {c['generation']}, {c['ms']} ms" for c in held)
    )
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) not in (2, 3):
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    results = json.loads(Path(sys.argv[1]).read_text())
    for size in results["sizes"]:
        log = Path(sys.argv[2] if len(sys.argv) == 3 else size["operator_log"]).read_text(errors="replace")
        job = size.get("job", "bench/bench")
        rows = split_failures(size["timeline"], log, job)
        print(f"=== {size['workers']} worker pods")
        print(format_split(rows, long_collections(log, size["timeline"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
