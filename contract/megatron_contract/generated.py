"""The command line shared by the generators of committed files (the CRD, the API reference, the
chart's values table): no flag prints, ``--write`` writes what differs, ``--check`` exits 1 naming
each file that differs (the tests and CI run it) and the command that regenerates it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping
from pathlib import Path


def generator_main(
    argv: list[str] | None,
    *,
    description: str,
    render: Callable[[], Mapping[Path, str]],
    source: str,
    remedy: str,
    root: Path,
    preview: Callable[[Mapping[Path, str]], str] | None = None,
    errors: tuple[type[BaseException], ...] = (),
) -> int:
    """Run a generator's command line.

    Args:
        render: the wanted content of every output file.
        source: what the files are generated from, for the message (e.g. "the models").
        remedy: the command that regenerates them (e.g. "make docs").
        preview: what no flag prints (default: the first output's content).
        errors: exceptions of ``render`` reported as a failure to generate (exit 2).
    """
    parser = argparse.ArgumentParser(description=description)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="write the generated files")
    mode.add_argument("--check", action="store_true", help="exit 1 if a committed file differs")
    args = parser.parse_args(argv)
    try:
        outputs = render()
    except errors as err:
        print(f"{parser.prog}: {err}", file=sys.stderr)
        return 2
    if args.write:
        for path, text in outputs.items():
            if not path.exists() or path.read_text() != text:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
            print(f"wrote {path.relative_to(root)}")
        return 0
    if args.check:
        stale = [p for p, text in outputs.items() if not p.exists() or p.read_text() != text]
        for path in stale:
            print(f"{path.relative_to(root)} differs from {source}; run `{remedy}`", file=sys.stderr)
        return 1 if stale else 0
    sys.stdout.write(preview(outputs) if preview else next(iter(outputs.values())))
    return 0
