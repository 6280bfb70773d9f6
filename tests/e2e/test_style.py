"""The house rules that take a tool: ruff's lint (pyproject.toml) over everything, and the root holding only the design
card's files and the commands a user runs (what git tracks). The import rules: tests/unit/test_style.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import PROJECT_DIR, ROOT_ENTRIES, assert_ok


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (requirements-test.txt has it)")
    result = subprocess.run([ruff, "check", "--no-cache", "."], cwd=PROJECT_DIR, capture_output=True, text=True)
    assert_ok(result)


def test_the_root_holds_the_design_cards_files_and_the_users_commands_only():
    tracked = subprocess.run(["git", "ls-files"], cwd=PROJECT_DIR, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    top = {line.split("/")[0] for line in tracked.stdout.splitlines() if not line.startswith(".")}
    assert sorted(top - ROOT_ENTRIES) == []
