"""The reviewable record of the patches: one unified diff per patched vLLM object, in ``patches/``.

The plugin applies its patches at run time (the modules of this package).
Each file ``patches/<target>.diff`` at the repository root shows one of them
as the edit it amounts to in vLLM 0.32.0's own source file, with that file's
SHA-256 in the diff's preamble:

- a wrapped function: upstream's ``def name`` is renamed ``_vllm_name``
  (its body unchanged, so it is not shown), and the patch's function, as
  the plugin defines it, follows under the upstream name; in its body,
  ``original`` is the renamed upstream function;
- a replaced class attribute or a widened ``Literal``: the lines that change.

``tests/test_patch_diffs.py`` renders every diff from the installed vLLM and
the live patches and compares it with the committed file: it fails when
vLLM's file or function moved, or when a patch changed without its diff.
To regenerate after a deliberate change (or on a new vLLM release)::

    python -m vllm_dsbd.engine.patches.diffs

then read the diffs (``git diff patches/``) and rerun ``make test``.
"""

from __future__ import annotations

import difflib
import hashlib
import inspect
import pathlib
import re
import sys
import textwrap
from dataclasses import dataclass
from typing import Any

from vllm_dsbd.engine.patches.pins import UPSTREAM_SHA256, upstream_function

ROOT = pathlib.Path(__file__).resolve().parents[3]
DIFF_DIR = ROOT / "patches"


@dataclass(frozen=True)
class Diff:
    """One patched vLLM object, as an edit of its upstream file."""

    target: str  # dotted name of what the patch changes
    number: int  # the patch's number in its header ("Patch 6 — ...")
    applied_by: str  # "vllm_dsbd/engine/patches/<module>.py (<patch function>)"
    upstream_path: str  # the file inside the vllm package, e.g. "vllm/sampling_params.py"
    upstream_text: str
    patched_text: str

    @property
    def file_name(self) -> str:
        return f"{self.target}.diff"

    def render(self) -> str:
        sha = hashlib.sha256(self.upstream_text.encode()).hexdigest()
        function_sha = UPSTREAM_SHA256.get(self.target)
        preamble = [
            f"vllm-dsbd patch {self.number}: {self.target}",
            f"applied at run time by {self.applied_by}",
            f"upstream: vLLM 0.32.0 {self.upstream_path}, sha256 {sha}",
        ]
        if function_sha:
            preamble.append(f"upstream function: sha256 {function_sha} (pins.UPSTREAM_SHA256)")
        preamble += ["regenerate: python -m vllm_dsbd.engine.patches.diffs", "", ""]
        body = difflib.unified_diff(
            self.upstream_text.splitlines(keepends=True),
            self.patched_text.splitlines(keepends=True),
            fromfile=f"a/{self.upstream_path}",
            tofile=f"b/{self.upstream_path}",
        )
        return "\n".join(preamble) + "".join(body)


def _vllm_path(obj: Any) -> tuple[str, str]:
    """``obj``'s source file as (path inside the vllm package, text)."""
    import vllm

    path = pathlib.Path(inspect.getsourcefile(obj)).resolve()
    rel = path.relative_to(pathlib.Path(vllm.__file__).resolve().parent.parent)
    return rel.as_posix(), path.read_text()


def _patch_number(module: pathlib.Path, patch_fn: str) -> int:
    """The number in the last "Patch N" header above ``def patch_fn`` in ``module``."""
    text = module.read_text()
    head = text[: text.index(f"\ndef {patch_fn}(")]
    numbers = re.findall(r"^# Patch (\d+) ", head, flags=re.MULTILINE)
    if not numbers:
        raise LookupError(f"no '# Patch N' header above {patch_fn} in {module.name}")
    return int(numbers[-1])


def wrapped_function_edit(upstream_text: str, function_lines: list[str], start: int, wrapper_source: str, note: str) -> str:
    """``upstream_text`` with the function at ``start`` (1-based) renamed ``_vllm_<name>``,
    followed by ``wrapper_source`` (at the function's indentation, under ``note``)."""
    lines = upstream_text.splitlines(keepends=True)
    first = start - 1
    if lines[first : first + len(function_lines)] != function_lines:
        raise ValueError(f"the function is not at line {start} of its file")
    def_at = next(i for i, line in enumerate(function_lines) if re.match(r"\s*(async\s+)?def\s", line))
    match = re.match(r"(\s*)((?:async\s+)?def\s+)(\w+)", function_lines[def_at])
    indent, name = match.group(1), match.group(3)
    renamed = function_lines[def_at].replace(f"def {name}(", f"def _vllm_{name.strip('_')}(", 1)
    decorators = function_lines[:def_at]
    wrapper = textwrap.indent(textwrap.dedent(wrapper_source), indent)
    comments = [f"{indent}# {line}\n" for line in note.splitlines()]
    end = first + len(function_lines)
    new = lines[: first + def_at] + [renamed] + lines[first + def_at + 1 : end]
    new += ["\n", *decorators, *comments, wrapper, *lines[end:]]
    return "".join(new)


def _wrapped_diffs() -> list[Diff]:
    """A diff for every upstream function in ``UPSTREAM_SHA256`` that a patch replaced."""
    import importlib

    out = []
    for target in sorted(UPSTREAM_SHA256):
        module_name, owner_name, attr = target.rsplit(".", 2)
        owner = getattr(importlib.import_module(module_name), owner_name, None)
        if not isinstance(owner, type):  # a module-level function: pinned, never replaced
            continue
        live = owner.__dict__[attr]
        live = getattr(live, "__func__", live)
        if not hasattr(live, "__dsbd_original__"):
            continue  # pinned because a patch or the engine relies on it, not replaced
        upstream = upstream_function(target)
        path, text = _vllm_path(upstream)
        function_lines, start = inspect.getsourcelines(upstream)
        module = pathlib.Path(live.__code__.co_filename)
        patch_fn = live.__code__.co_qualname.split(".")[0]
        number = _patch_number(module, patch_fn)
        applied_by = f"vllm_dsbd/engine/patches/{module.name} ({patch_fn})"
        note = (
            f"vllm-dsbd patch {number}, applied at run time by {applied_by}.\n"
            f"In its body, `original` is vLLM's {attr}, renamed _vllm_{attr.strip('_')} above."
        )
        patched = wrapped_function_edit(text, function_lines, start, inspect.getsource(live), note)
        out.append(Diff(target, number, applied_by, path, text, patched))
    return out


def replace_lines(text: str, anchor: str, old: list[str], new: list[str]) -> str:
    """``text`` with the first run of lines ``old`` after the line starting ``anchor`` replaced by ``new``."""
    lines = [line.rstrip("\n") for line in text.splitlines()]
    at = next((i for i, line in enumerate(lines) if line.startswith(anchor)), None)
    found = None
    if at is not None:
        found = next((i for i in range(at, len(lines)) if lines[i : i + len(old)] == old), None)
    if found is None:
        raise ValueError(f"upstream moved: {old!r} is not after {anchor!r}")
    return "\n".join(lines[:found] + new + lines[found + len(old) :]) + "\n"


def _attribute_diffs() -> list[Diff]:
    """Patches 1 and 10, which change a type alias and a class attribute rather than a function."""
    from vllm.config import speculative
    from vllm.v1.metrics import loggers

    out = []
    path, text = _vllm_path(speculative)
    patched = replace_lines(
        text,
        "SpeculativeMethod = Literal[",
        ["    DSparkModelTypes,", "]"],
        ["    DSparkModelTypes,", '    "dsbd",  # vllm-dsbd patch 1: also SpeculativeConfig.method\'s annotation', "]"],
    )
    applied_by = "vllm_dsbd/engine/patches/engine_config.py (_add_method_to_literal)"
    out.append(Diff("vllm.config.speculative.SpeculativeMethod", 1, applied_by, path, text, patched))
    path, text = _vllm_path(loggers)
    patched = replace_lines(
        text,
        "class PrometheusStatLogger(",
        ["    _spec_decoding_cls = SpecDecodingProm"],
        ["    _spec_decoding_cls = DSBDSpecDecodingProm  # vllm-dsbd patch 10: vllm_dsbd.engine.metrics"],
    )
    applied_by = "vllm_dsbd/engine/patches/stat_logger.py (_dsbd_spec_decoding_metrics)"
    out.append(Diff("vllm.v1.metrics.loggers.PrometheusStatLogger._spec_decoding_cls", 10, applied_by, path, text, patched))
    return out


def all_diffs() -> list[Diff]:
    """Every patch's diff, rendered from the installed vLLM and the applied patches."""
    from vllm_dsbd.engine.patches import apply_all

    apply_all()
    return sorted(_wrapped_diffs() + _attribute_diffs(), key=lambda d: (d.number, d.target))


def main(argv: list[str] | None = None) -> int:
    """Rewrite ``patches/*.diff`` from the installed vLLM; remove diffs no patch has any more."""
    DIFF_DIR.mkdir(exist_ok=True)
    diffs = all_diffs()
    keep = {d.file_name for d in diffs}
    for stale in DIFF_DIR.glob("*.diff"):
        if stale.name not in keep:
            stale.unlink()
            print(f"removed {stale.relative_to(ROOT)}")
    for d in diffs:
        (DIFF_DIR / d.file_name).write_text(d.render())
        print(f"patch {d.number:>2}: patches/{d.file_name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
