"""A prepared model's cache directory: its manifest, and how it is built.

Every prepared model lives in its own directory under the cache root and is
written to a temporary sibling first, then renamed. A ``dsbd-manifest.json``
listing every file with its size and SHA-256 is written last, so a directory
without a matching manifest (an interrupted or tampered write) is never used.
Used by :mod:`vllm_dsbd.models`, :mod:`vllm_dsbd.pairs` and the default draft
(:mod:`vllm_dsbd.draft`); it imports none of them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

MANIFEST = "dsbd-manifest.json"

# Bump when the conversion changes, so stale caches are rebuilt.
_FORMAT_VERSION = 1


def sha256_file(path: Path) -> str:
    """The file's SHA-256, hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(model_dir: Path, source: dict) -> None:
    files = sorted(p for p in model_dir.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest = {
        "format": _FORMAT_VERSION,
        "source": source,
        "files": {
            str(p.relative_to(model_dir)): {"size": p.stat().st_size, "sha256": sha256_file(p)}
            for p in files
        },
    }
    (model_dir / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))


def is_complete(model_dir: Path, source: dict | None = None, *, checksums: bool = False) -> bool:
    """Whether ``model_dir`` holds a complete model matching its manifest.

    Sizes are always checked; SHA-256 too with ``checksums=True``. With
    ``source`` given, the manifest must also record that source.
    """
    try:
        manifest = json.loads((model_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("format") != _FORMAT_VERSION or not manifest.get("files"):
        return False
    if source is not None and manifest.get("source") != source:
        return False
    for rel, meta in manifest["files"].items():
        p = model_dir / rel
        if not p.is_file() or p.stat().st_size != meta["size"]:
            return False
        if checksums and sha256_file(p) != meta["sha256"]:
            return False
    return True


def build_atomically(final_dir: Path, source: dict, build) -> Path:
    """Run ``build(tmp_dir)``, write the manifest, then rename into place. One process builds a model at a
    time (:func:`_build_lock`): another that wants the same one (two test workers, the demo beside the
    tests) waits, then finds it complete instead of replacing it while it is being read."""
    if is_complete(final_dir, source):
        return final_dir
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(final_dir):
        if is_complete(final_dir, source):  # built meanwhile
            return final_dir
        tmp = Path(tempfile.mkdtemp(prefix=f".{final_dir.name}.", dir=final_dir.parent))
        try:
            build(tmp)
            write_manifest(tmp, source)
            if final_dir.exists():
                shutil.rmtree(final_dir)  # incomplete or stale
            tmp.chmod(0o755)  # mkdtemp makes it private
            os.replace(tmp, final_dir)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final_dir


@contextlib.contextmanager
def _build_lock(final_dir: Path):
    """An exclusive ``flock`` for building ``final_dir``, on a file in the temp directory named by the path's
    hash (not beside the model: the cache holds models only), released on exit. Lock files are never removed
    (removing one another process waits on would let a third lock a new file)."""
    key = hashlib.sha256(str(final_dir.resolve()).encode()).hexdigest()[:24]
    locks = Path(tempfile.gettempdir()) / "vllm-dsbd-locks"
    locks.mkdir(mode=0o1777, exist_ok=True)
    with open(locks / f"{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
