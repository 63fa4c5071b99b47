"""The package's modules, and the benchmarks', import one another without cycles (function-level imports included).

Cycles make the import order matter and the code hard to follow; the rooms of
architecture (algorithm, engine, user surface) import downwards only. The
graph is read from the source with ``ast``: every ``import`` / ``from ...
import`` of a ``vllm_dsbd`` module, wherever it sits in the file.
"""

from __future__ import annotations

import ast
from pathlib import Path

import vllm_dsbd

ROOT = Path(vllm_dsbd.__file__).parent
BENCHMARKS = ROOT.parent / "benchmarks"


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of ``root``'s package it imports (the package itself left out)."""
    modules = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:  # a.b.C -> a.b
                    target = target.rpartition(".")[0]
                if target and target != name and target != root.name:
                    graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_imports_inside_functions():
    graph = import_graph()
    # models.prepare_default_pair imports the draft in a function
    assert "vllm_dsbd.draft" in graph["vllm_dsbd.models"]
    assert "vllm_dsbd.model_cache" in graph["vllm_dsbd.draft"]


def test_cycle_finder_finds_a_planted_cycle():
    planted = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(planted) == [["a", "b", "c"]]


#: None left: ``prepare`` / ``pair_paths`` by pair name live in ``pairs`` only (``models`` used to dispatch
#: to them, while ``pairs``' registry holds the default pair that ``models`` builds).
KNOWN_CYCLES: list[list[str]] = []


def test_no_import_cycles():
    found = cycles(import_graph())
    assert found == KNOWN_CYCLES, f"import cycles: {found}"


def test_no_import_cycles_in_the_benchmarks():
    graph = import_graph(BENCHMARKS)
    assert "benchmarks.fuzz_requests" in graph["benchmarks.fuzz_served"]  # the graph sees them
    assert cycles(graph) == [], f"import cycles: {cycles(graph)}"


def test_draft_engine_and_entrypoints_import_downwards():
    graph = import_graph()
    assert "vllm_dsbd.models" not in graph["vllm_dsbd.draft"]
    assert "vllm_dsbd.engine.patches" not in graph["vllm_dsbd.engine.metrics"]
    assert "vllm_dsbd.engine.patches" not in graph["vllm_dsbd.entrypoints.beam_search"]
    algorithm = [m for m in graph if m.startswith("vllm_dsbd.algorithm")]
    assert algorithm and not any(t.startswith(("vllm_dsbd.engine", "vllm_dsbd.entrypoints"))
                                 for m in algorithm for t in graph[m])
