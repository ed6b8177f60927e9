"""A checkpoint's files (``worker/checkpoint_files.py``) on a real directory, without torch.

Scenarios: publishing a fully written partial checkpoint writes a manifest of every file and
renames it into place; a partial checkpoint missing a rank's part is refused and stays partial;
republishing a step replaces the earlier checkpoint of that step; retention keeps the newest
complete checkpoints and drops partial ones older than the newest; verification notices a
truncated file, a flipped bit (naming its chunk), a missing file, a missing manifest and another
configuration, and still reads manifests with one sha256 per file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_trainer.worker import checkpoint_files
from megatron_trainer.worker.checkpoint_files import (
    MANIFEST,
    ManifestError,
    checkpoint_dir,
    complete_steps,
    newest_complete,
    partial_dir,
    prune,
    publish,
    read_manifest,
    verify_files,
    write_part,
)

HEADER = {"step": 4, "epoch": 1, "mesh": {"world": 2}, "config_hash": "abc"}


def written(root: Path, step: int, ranks: int = 2) -> Path:
    """A partial checkpoint as the writers and Megatron's finalization leave it."""
    directory = partial_dir(root, step)
    directory.mkdir(parents=True)
    for rank in range(ranks):
        data = directory / f"__{rank}_0.distcp"
        data.write_bytes(bytes(range(256)) * (rank + 1) + str(step).encode())
        write_part(directory, rank, [data])
    (directory / "common.pt").write_bytes(b"common")
    (directory / "metadata.json").write_text("{}")
    return directory


def test_publish_writes_the_manifest_and_renames_into_place(tmp_path: Path) -> None:
    directory = written(tmp_path, 4)
    assert complete_steps(tmp_path) == []
    manifest = publish(directory, checkpoint_dir(tmp_path, 4), 2, HEADER)
    target = checkpoint_dir(tmp_path, 4)
    assert not directory.exists() and complete_steps(tmp_path) == [4] and newest_complete(tmp_path) == 4
    assert json.loads((target / MANIFEST).read_text()) == manifest
    assert set(manifest["files"]) == {p.name for p in target.iterdir()} - {MANIFEST}
    assert manifest["files"]["__1_0.distcp"]["size"] == 512 + 1
    assert {k: manifest[k] for k in HEADER} == HEADER
    verify_files(target, read_manifest(target, "abc"), manifest["files"])


def test_a_missing_rank_part_keeps_the_checkpoint_partial(tmp_path: Path) -> None:
    directory = written(tmp_path, 4, ranks=1)
    with pytest.raises(ManifestError, match="1 of 2 ranks"):
        publish(directory, checkpoint_dir(tmp_path, 4), 2, HEADER)
    assert directory.is_dir() and complete_steps(tmp_path) == []


def test_republishing_a_step_replaces_the_earlier_checkpoint(tmp_path: Path) -> None:
    publish(written(tmp_path, 4), checkpoint_dir(tmp_path, 4), 2, HEADER)
    first = json.loads((checkpoint_dir(tmp_path, 4) / MANIFEST).read_text())
    publish(written(tmp_path, 4), checkpoint_dir(tmp_path, 4), 2, {**HEADER, "epoch": 2})
    second = json.loads((checkpoint_dir(tmp_path, 4) / MANIFEST).read_text())
    assert (first["epoch"], second["epoch"]) == (1, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint_dir(tmp_path, 4).name]


def test_retention_keeps_the_newest_complete_and_drops_stale_partials(tmp_path: Path) -> None:
    for step in (2, 4, 6):
        publish(written(tmp_path, step), checkpoint_dir(tmp_path, step), 2, {**HEADER, "step": step})
    written(tmp_path, 3)  # a save cut short
    written(tmp_path, 8)  # a save still being written
    deleted = prune(tmp_path, keep=2)
    assert sorted(p.name for p in deleted) == sorted([checkpoint_dir(tmp_path, 2).name, partial_dir(tmp_path, 3).name])
    assert complete_steps(tmp_path) == [6, 4] and partial_dir(tmp_path, 8).is_dir()


@pytest.mark.parametrize("damage", ["truncated", "flipped", "missing"])
def test_verification_notices_damaged_files(tmp_path: Path, damage: str) -> None:
    manifest = publish(written(tmp_path, 4), checkpoint_dir(tmp_path, 4), 2, HEADER)
    target = checkpoint_dir(tmp_path, 4)
    victim = target / "__1_0.distcp"
    data = victim.read_bytes()
    if damage == "truncated":
        victim.write_bytes(data[:-1])
    elif damage == "flipped":
        victim.write_bytes(data[:10] + bytes([data[10] ^ 1]) + data[11:])
    else:
        victim.unlink()
    expected = {"truncated": "truncated", "flipped": "sha256", "missing": "missing"}[damage]
    with pytest.raises(ManifestError, match=expected):
        verify_files(target, manifest, manifest["files"])
    verify_files(target, manifest, ["__0_0.distcp"])  # the other files are intact


def test_a_missing_manifest_or_another_configuration_is_refused(tmp_path: Path) -> None:
    publish(written(tmp_path, 4), checkpoint_dir(tmp_path, 4), 2, HEADER)
    target = checkpoint_dir(tmp_path, 4)
    with pytest.raises(ManifestError, match="another model/optimizer configuration"):
        read_manifest(target, "def")
    (target / MANIFEST).unlink()
    with pytest.raises(ManifestError, match=r"no manifest\.json"):
        read_manifest(target, "abc")
    assert complete_steps(tmp_path) == []
    with pytest.raises(ManifestError, match="does not exist"):
        read_manifest(checkpoint_dir(tmp_path, 6), "abc")


def test_checksums_cover_every_chunk_and_name_the_damaged_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Files are hashed in chunks (on several threads); a flip in a later chunk is found there,
    and a manifest from before chunk checksums (one sha256 per file) still verifies."""
    monkeypatch.setattr(checkpoint_files, "CHECKSUM_CHUNK", 100)
    manifest = publish(written(tmp_path, 4), checkpoint_dir(tmp_path, 4), 2, HEADER)
    target = checkpoint_dir(tmp_path, 4)
    entry = manifest["files"]["__1_0.distcp"]
    assert entry["chunk_bytes"] == 100 and len(entry["sha256_chunks"]) == 6  # 513 bytes
    victim = target / "__1_0.distcp"
    data = victim.read_bytes()
    victim.write_bytes(data[:350] + bytes([data[350] ^ 1]) + data[351:])
    with pytest.raises(ManifestError, match=r"chunk 3 \(from byte 300\)"):
        verify_files(target, manifest, ["__1_0.distcp"])
    victim.write_bytes(data)
    old = {"size": len(data), "sha256": checkpoint_files.sha256_of(victim)}
    verify_files(target, {"files": {"__1_0.distcp": old}}, ["__1_0.distcp"])
    victim.write_bytes(data[:-1] + b"?")
    with pytest.raises(ManifestError, match="sha256"):
        verify_files(target, {"files": {"__1_0.distcp": old}}, ["__1_0.distcp"])
