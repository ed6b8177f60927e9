"""A checkpoint's files on disk: where they go, the manifest that makes them complete, how they are
verified, published and retired. torch-free: only paths, JSON and hashes.

Layout under ``spec.checkpoint.path``::

    .partial-step-000000004/   being written (every rank's files, then Megatron's metadata)
    step-000000004/            complete: renamed from the partial name after the manifest was written
        manifest.json          step, mesh, config hash, every other file's size and checksums
        rank-00000.json ...    one rank's files, sizes and checksums, written by that rank's writer

A directory named ``step-*`` holding a manifest is complete by construction: the manifest is
written (and fsynced) last and the rename is atomic, so a save cut short leaves only a partial
directory that nothing loads. Loading still checks every size and checksum against the manifest:
storage can truncate or flip bits after the fact.

A file's checksums are the sha256 of each 32 MiB chunk, so that a rank hashes its files on several
threads (hashlib and reads release the GIL): one sha256 over a whole file runs on one core, about
1-2 GB/s, and a rank of a 1 B model writes and reads a 15 GB share. Manifests that hold one
``sha256`` per file (written before chunks) are still verified.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
PART_PREFIX = "rank-"
COMPLETE_PREFIX = "step-"
PARTIAL_PREFIX = ".partial-step-"
_CHUNK = 4 * 1024 * 1024
CHECKSUM_CHUNK = 32 * 1024 * 1024
_HASH_THREADS = min(8, os.cpu_count() or 1)


class ManifestError(ValueError):
    """A checkpoint that must not be loaded: the reason says what is wrong with it."""


def checkpoint_dir(root: str | Path, step: int) -> Path:
    """Directory of the complete checkpoint taken after ``step`` completed steps."""
    return Path(root) / f"{COMPLETE_PREFIX}{step:09d}"


def partial_dir(root: str | Path, step: int) -> Path:
    """Directory the checkpoint of ``step`` is written to before it is complete."""
    return Path(root) / f"{PARTIAL_PREFIX}{step:09d}"


def _step_of(name: str, prefix: str) -> int | None:
    if not name.startswith(prefix):
        return None
    tail = name[len(prefix) :]
    return int(tail) if tail.isdigit() else None


def complete_steps(root: str | Path) -> list[int]:
    """Steps of the complete checkpoints under ``root`` (renamed into place, manifest present), newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    steps = [
        s for p in root.iterdir() if (s := _step_of(p.name, COMPLETE_PREFIX)) is not None and (p / MANIFEST).exists()
    ]
    return sorted(steps, reverse=True)


def newest_complete(root: str | Path) -> int | None:
    """Step of the newest complete checkpoint under ``root``, or None."""
    steps = complete_steps(root)
    return steps[0] if steps else None


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _chunk_sha256(path: Path, offset: int, length: int) -> str:
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY)
    try:
        end = offset + length
        while offset < end:
            data = os.pread(fd, min(_CHUNK, end - offset), offset)
            if not data:  # shorter than it was a moment ago
                break
            digest.update(data)
            offset += len(data)
    finally:
        os.close(fd)
    return digest.hexdigest()


def chunk_checksums(paths: Iterable[Path]) -> dict[Path, list[str]]:
    """sha256 of every ``CHECKSUM_CHUNK`` bytes of each file, hashed on several threads."""
    work = [
        (p, offset, min(CHECKSUM_CHUNK, size - offset))
        for p in paths
        for size in [p.stat().st_size]
        for offset in range(0, max(size, 1), CHECKSUM_CHUNK)
    ]
    with ThreadPoolExecutor(_HASH_THREADS, thread_name_prefix="checksum") as pool:
        digests = list(pool.map(lambda w: _chunk_sha256(*w), work))
    out: dict[Path, list[str]] = {}
    for (path, _, _), digest in zip(work, digests, strict=True):
        out.setdefault(path, []).append(digest)
    return out


def describe(paths: Iterable[Path]) -> dict[str, dict[str, Any]]:
    """Size and chunk checksums of each file, by file name."""
    checksums = chunk_checksums(list(paths))
    return {
        p.name: {"size": p.stat().st_size, "chunk_bytes": CHECKSUM_CHUNK, "sha256_chunks": digests}
        for p, digests in checksums.items()
    }


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, payload: Mapping[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(path)


def write_part(directory: Path, rank: int, files: Iterable[Path]) -> None:
    """Record the files one rank wrote (sizes, checksums); runs in that rank's writer."""
    _write_durably(directory / f"{PART_PREFIX}{rank:05d}.json", {"rank": rank, "files": describe(files)})


def publish(
    directory: Path, target: Path, world_size: int, header: Mapping[str, Any], retired: Path | None = None
) -> dict[str, Any]:
    """Make a fully written partial checkpoint complete: check every rank's part is there, write
    the manifest (the parts' checksums, plus those of the files Megatron's finalization wrote),
    fsync everything, rename ``directory`` to ``target``. Called by one rank once all are done.

    An existing ``target`` (an earlier checkpoint of the same step, e.g. redone after a restore) is
    moved to ``retired`` first and deleted after the rename. Returns the manifest.
    """
    parts = sorted(directory.glob(f"{PART_PREFIX}*.json"))
    if len(parts) != world_size:
        raise ManifestError(f"{len(parts)} of {world_size} ranks recorded their files in {directory}")
    files: dict[str, dict[str, Any]] = {}
    for part in parts:
        files.update(json.loads(part.read_text())["files"])
    listed = {p.name for p in directory.iterdir() if p.is_file()}
    described = set(files) | {p.name for p in parts}
    rest = sorted(n for n in listed - described if not n.endswith(".tmp"))
    files.update(describe(directory / n for n in rest))
    files.update(describe(parts))
    for name in files:
        _fsync(directory / name)
    manifest = {**header, "files": files, "written_at": time.time()}
    _write_durably(directory / MANIFEST, manifest)
    _fsync(directory)
    if target.exists():
        retired = retired or target.with_name(f".retired-{target.name}")
        shutil.rmtree(retired, ignore_errors=True)
        target.rename(retired)
    directory.rename(target)
    _fsync(target.parent)
    if retired is not None and retired.exists():
        shutil.rmtree(retired, ignore_errors=True)
    return manifest


def read_manifest(directory: Path, config_hash: str) -> dict[str, Any]:
    """The manifest of a complete checkpoint, checked against the job's model configuration."""
    if not directory.is_dir():
        raise ManifestError(f"{directory} does not exist")
    path = directory / MANIFEST
    if not path.exists():
        raise ManifestError(f"{directory} has no {MANIFEST} (never completed, or damaged)")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as err:
        raise ManifestError(f"{path} is unreadable: {err}") from err
    if manifest.get("config_hash") != config_hash:
        raise ManifestError(
            f"{directory} was written for another model/optimizer configuration"
            f" (hash {manifest.get('config_hash')}, this job's {config_hash})"
        )
    if not isinstance(files, dict) or not files:
        raise ManifestError(f"{path} lists no files")
    return manifest


def verify_files(directory: Path, manifest: Mapping[str, Any], names: Iterable[str]) -> None:
    """Check size and checksums of ``names`` (a share of the manifest's files) against the manifest."""
    chunked: list[Path] = []
    for name in names:
        expected = manifest["files"][name]
        path = directory / name
        if not path.exists():
            raise ManifestError(f"{path} is missing")
        size = path.stat().st_size
        if size != expected["size"]:
            raise ManifestError(f"{path} has {size} bytes, the manifest says {expected['size']} (truncated?)")
        if "sha256_chunks" not in expected:  # a manifest from before chunk checksums
            if sha256_of(path) != expected.get("sha256"):
                raise ManifestError(f"{path} does not match its sha256 in the manifest (corrupted)")
        elif expected.get("chunk_bytes") != CHECKSUM_CHUNK:
            raise ManifestError(f"{path}: the manifest's checksums are of {expected.get('chunk_bytes')}-byte chunks")
        else:
            chunked.append(path)
    for path, digests in chunk_checksums(chunked).items():
        expected_digests = manifest["files"][path.name]["sha256_chunks"]
        if digests != expected_digests:
            bad = next((i for i, (d, e) in enumerate(zip(digests, expected_digests, strict=False)) if d != e), None)
            where = f"chunk {bad} (from byte {bad * CHECKSUM_CHUNK})" if bad is not None else "its chunk count"
            raise ManifestError(f"{path} does not match its sha256 in the manifest at {where} (corrupted)")


def prune(root: str | Path, keep: int) -> list[Path]:
    """Delete complete checkpoints beyond the ``keep`` newest, and partial ones older than the
    newest complete (a save that was cut short). Returns what was deleted."""
    root = Path(root)
    steps = complete_steps(root)
    if not steps:
        return []
    doomed = [checkpoint_dir(root, s) for s in steps[keep:]]
    doomed += [p for p in root.iterdir() if (s := _step_of(p.name, PARTIAL_PREFIX)) is not None and s <= steps[0]]
    doomed += list(root.glob(f".retired-{COMPLETE_PREFIX}*"))
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
        log.info("checkpoint %s deleted (keeping the %d newest complete)", path.name, keep)
    return doomed


def config_hash(model: Mapping[str, Any], precision: str) -> str:
    """Hash of what the saved tensors' shapes and dtypes depend on: the model's configuration and
    the training precision. A checkpoint with another hash cannot be loaded into this job."""
    text = json.dumps({"model": model, "precision": precision}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
