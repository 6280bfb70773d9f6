"""mingpt/startup.py: a command's imports made without the cyclic collector walking them, then frozen; a module that
only imports a command's script leaves its process's collector alone."""

import ast
import gc

import pytest
from support import PROJECT_DIR

from mingpt import startup

COMMANDS = ("main.py", "sample.py", "snapshot.py", "prepare.py")


@pytest.fixture
def collector_restored():
    enabled = gc.isenabled()
    yield
    gc.unfreeze()  # what a test froze goes back to the oldest generation of this pytest process
    if enabled:
        gc.enable()
    else:
        gc.disable()


def test_a_commands_own_process_imports_without_collection_then_freezes_what_they_made(collector_restored):
    frozen = gc.get_freeze_count()
    startup.pause_collection("__main__")
    assert not gc.isenabled()
    made = [[] for _ in range(1000)]  # tracked containers, as imports make them
    startup.resume_collection("__main__")
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen + len(made)


def test_an_imported_script_leaves_the_collector_alone(collector_restored):
    gc.enable()
    frozen = gc.get_freeze_count()
    startup.pause_collection("main")  # main.py imported by a test, a benchmark or prepare.py
    assert gc.isenabled()
    startup.resume_collection("main")
    assert gc.get_freeze_count() == frozen


@pytest.mark.parametrize("script", COMMANDS)
def test_each_command_pauses_before_its_imports_and_resumes_after_them(script):
    """At the script's top level: pause_collection(__name__) before every import but the startup module's own (and
    __future__'s), resume_collection(__name__) after the last."""
    body = ast.parse((PROJECT_DIR / script).read_text(encoding="utf-8")).body
    calls = {node.value.func.attr: index for index, node in enumerate(body)
             if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
             and isinstance(node.value.func, ast.Attribute) and isinstance(node.value.func.value, ast.Name)
             and node.value.func.value.id == "startup"
             and [ast.unparse(a) for a in node.value.args] == ["__name__"]}
    assert set(calls) == {"pause_collection", "resume_collection"}, script
    imports = [index for index, node in enumerate(body)
               if isinstance(node, (ast.Import, ast.ImportFrom)) and not _comes_first(node)]
    assert calls["pause_collection"] < min(imports) and max(imports) < calls["resume_collection"], script


def _comes_first(node: ast.stmt) -> bool:
    """The imports allowed before the pause: __future__'s, the startup module itself, main.py's orphans guard."""
    if not isinstance(node, ast.ImportFrom):
        return False
    names = [alias.name for alias in node.names]
    return node.module in ("__future__", "mingpt.distributed.orphans") or (node.module == "mingpt"
                                                                           and names == ["startup"])
