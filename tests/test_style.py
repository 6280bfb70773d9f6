"""The house rules, checked: ruff's lint (pyproject.toml) over everything, the root holding only the design card's
files and the commands a user runs, and the sizes and imports of every module (the root's, the mingpt package's,
benchmarks/ and slurm/): no class over 250 lines, no function over 50, main.py at most 200, no module over a fifth
of the code, no import cycle between the project's modules, lazy imports included."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import PROJECT_DIR, ROOT_ENTRIES, assert_ok, module_name, project_modules

MODULES = project_modules()


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (requirements-test.txt has it)")
    result = subprocess.run([ruff, "check", "--no-cache", "."], cwd=PROJECT_DIR, capture_output=True, text=True)
    assert_ok(result)


def definitions(tree: ast.Module):
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node, node.end_lineno - node.lineno + 1


def test_no_class_over_250_lines_no_function_over_50():
    too_long = []
    for path in MODULES:
        for node, length in definitions(ast.parse(path.read_text(encoding="utf-8"))):
            limit = 250 if isinstance(node, ast.ClassDef) else 50
            if length > limit:
                too_long.append(f"{path.relative_to(PROJECT_DIR)}:{node.lineno} {node.name} ({length} lines)")
    assert too_long == []


def test_main_is_short_and_no_module_holds_over_a_fifth_of_the_code():
    lines = {module_name(path): len(path.read_text(encoding="utf-8").splitlines()) for path in MODULES}
    assert lines["main"] <= 200
    total = sum(lines.values())
    assert [name for name, n in lines.items() if n > total / 5] == []


def imported_modules(path: Path, names: set[str]) -> set[str]:
    """The project's modules `path` imports anywhere in it (at the top, in a function, under TYPE_CHECKING):
    `import a.b` and `from a import b` both count as a.b where that is a module, else as a."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"{node.module}.{alias.name}" for alias in node.names} | {node.module}
    return {name for name in found if name in names} - {module_name(path)}


def test_no_import_cycle_between_the_projects_modules():
    names = {module_name(path) for path in MODULES}
    graph = {module_name(path): imported_modules(path, names) for path in MODULES}
    cycles = []
    for start in sorted(graph):
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph[node]):
                if nxt == start:
                    cycles.append(" -> ".join([*path, nxt]))
                elif nxt not in path:
                    stack.append((nxt, [*path, nxt]))
    assert cycles == []


def test_the_root_holds_the_design_cards_files_and_the_users_commands_only():
    tracked = subprocess.run(["git", "ls-files"], cwd=PROJECT_DIR, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    top = {line.split("/")[0] for line in tracked.stdout.splitlines() if not line.startswith(".")}
    assert sorted(top - ROOT_ENTRIES) == []
