"""The package's layers: every import goes down (or stays within its own stage), and the
imports, at module level or inside functions, form no cycle, across stages or inside one. Read
from the source with `ast`, so it needs no import.

    errors, naming, progress, plan < onnx_facts, ir, runtime < flops, io < autodiff (a leaf: the
    gradient builder reads only the layers below) < analysis < deployment < options, report
    < transform < api < toggles < checks < training < driver < cli_parser < cli < __main__,
    the package's __init__
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parents[2] / "amp_rewrite"
RANK = {
    "errors": 0,
    "naming": 0,
    "progress": 0,
    "op_lists": 0,
    "plan": 0,
    "onnx_facts": 1,
    "ir": 1,
    "runtime": 1,
    "flops": 2,
    "io": 2,
    "autodiff": 2.5,
    "analysis": 3,
    "deployment": 3.5,
    "options": 4,
    "report": 4,
    "transform": 5,
    "api": 6,
    "toggles": 7,
    "checks": 8,
    "training": 10,
    "driver": 10.5,
    "cli_parser": 10.75,
    "cli": 11,
    "__init__": 12,
    "__main__": 12,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def stage(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: Path):
    """(imported amp_rewrite module, at module level?) for every import in the file."""
    tree = ast.parse(path.read_text())
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    top_level = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "amp_rewrite":
                continue
            for alias in node.names:  # `from amp_rewrite.x import y`: y may be a module
                candidate = f"{base}.{alias.name}"
                yield (
                    (
                        candidate
                        if (PACKAGE.parent / candidate.replace(".", "/")).with_suffix(".py").exists()
                        or (PACKAGE.parent / candidate.replace(".", "/")).is_dir()
                        else base
                    ),
                    id(node) in top_level,
                )
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "amp_rewrite":
                    yield alias.name, id(node) in top_level


def test_imports_only_go_down():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = module_name(path)
        for imported, _ in imports(path):
            a, b = stage(importer), stage(imported)
            if imported == "amp_rewrite" and a != "__init__":
                wrong.append(f"{importer} imports the package root")
            elif a != b and RANK[b] >= RANK[a] and b != "__init__":
                wrong.append(f"{importer} ({a}) imports {imported} ({b})")
    assert not wrong, "\n".join(wrong)


def test_io_and_analysis_know_nothing_above_them():
    for path in sorted((PACKAGE / "io").rglob("*.py")) + sorted((PACKAGE / "analysis").rglob("*.py")):
        for imported, _ in imports(path):
            assert stage(imported) in ("onnx_facts", "ir", "plan", "errors", "naming", "io", "analysis"), (
                path.name,
                imported,
            )


def import_graph() -> nx.DiGraph:
    """module -> the amp_rewrite modules it imports anywhere in its source. A package's __init__
    importing its own modules is an edge too: a module that imports its package back closes a
    cycle that fails at import time."""
    graph = nx.DiGraph()
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = module_name(path)
        graph.add_node(importer)
        for imported, _ in imports(path):
            if imported != importer:
                graph.add_edge(importer, imported)
    return graph


def test_no_import_cycles():
    cycles = list(nx.simple_cycles(import_graph()))
    assert not cycles, cycles[:5]


def test_the_cycle_check_sees_function_level_imports_within_one_stage(tmp_path, monkeypatch):
    package = tmp_path / "amp_rewrite"
    (package / "training").mkdir(parents=True)
    (package / "training" / "__init__.py").write_text("")
    (package / "training" / "a.py").write_text("from amp_rewrite.training import b\n")
    (package / "training" / "b.py").write_text("def f():\n    from amp_rewrite.training.a import g\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    cycles = [sorted(c) for c in nx.simple_cycles(import_graph())]
    assert cycles == [["amp_rewrite.training.a", "amp_rewrite.training.b"]]


def test_the_cycle_check_sees_a_module_importing_its_own_package(tmp_path, monkeypatch):
    package = tmp_path / "amp_rewrite"
    (package / "io").mkdir(parents=True)
    (package / "io" / "__init__.py").write_text("from amp_rewrite.io.a import f\n")
    (package / "io" / "a.py").write_text("def f():\n    from amp_rewrite.io import g\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    cycles = [sorted(c) for c in nx.simple_cycles(import_graph())]
    assert cycles == [["amp_rewrite.io", "amp_rewrite.io.a"]]
