"""The house rules on the imports of every module (the root's, the mingpt package's, benchmarks/ and slurm/), lazy
imports included: no import cycle between the project's modules, and dependencies that point one way (the commands at
the root -> the core at the root -> the mingpt package, which never imports the root). The trainer's behaviour lives
in its own methods: no function of trainer.py takes a Trainer. (Sizes are not capped: a class is as long as its one
concept needs.) Ruff and the root's layout: tests/e2e/test_style.py."""

from __future__ import annotations

import ast
from pathlib import Path

from support import PROJECT_DIR, module_name, project_modules

MODULES = project_modules()


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


ROOT_MODULES = {module_name(path) for path in MODULES if path.parent == PROJECT_DIR}


def test_the_package_never_imports_the_root():
    """Dependencies point one way: no module under mingpt/ imports a root module (main, trainer, model,
    char_dataset, the commands), at the top, in a function or under TYPE_CHECKING. What the package needs of the
    root (the config schema, the model config for the Hugging Face export) the root hands it."""
    names = {module_name(path) for path in MODULES}
    offenders = {module_name(path): sorted(imported_modules(path, names) & ROOT_MODULES)
                 for path in MODULES if module_name(path).startswith("mingpt")}
    assert {name: roots for name, roots in offenders.items() if roots} == {}
    assert {"main", "trainer", "model", "char_dataset"} <= ROOT_MODULES  # the check sees the root


def test_the_core_at_the_root_never_imports_a_command():
    """trainer.py, model.py and char_dataset.py are the core the commands use: none imports main.py, sample.py,
    snapshot.py, prepare.py or plot.py; model.py imports no other module of the project but mingpt.errors."""
    names = {module_name(path) for path in MODULES}
    commands = ROOT_MODULES - {"trainer", "model", "char_dataset"}
    for core in ("trainer", "model", "char_dataset"):
        assert imported_modules(PROJECT_DIR / f"{core}.py", names) & commands == set(), core
    assert imported_modules(PROJECT_DIR / "model.py", names) <= {"mingpt.errors", "mingpt"}


def test_no_function_of_trainer_py_takes_the_trainer():
    """The Trainer's behaviour is in its own methods: no top-level function of trainer.py takes it as an argument
    (and so none sets its attributes from outside)."""
    tree = ast.parse((PROJECT_DIR / "trainer.py").read_text(encoding="utf-8"))
    taking = [node.name for node in tree.body if isinstance(node, ast.FunctionDef)
              for arg in node.args.args + node.args.kwonlyargs
              if arg.annotation is not None and "Trainer" == ast.unparse(arg.annotation).strip("'\"")]
    assert taking == []
