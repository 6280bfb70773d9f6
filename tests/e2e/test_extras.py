"""The optional parts that are not trackers (tests/e2e/test_trackers.py has theirs): `snapshot.py export --format hf`
without transformers or tokenizers stops in one line giving the install command, before it reads the snapshot."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from support import PROJECT_DIR, assert_one_error_line, cli, subprocess_env


@pytest.mark.parametrize("module", ["transformers", "tokenizers"])
def test_the_hf_export_without_its_packages_is_a_one_line_error_naming_the_install_command(module, tmp_path: Path):
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "sitecustomize.py").write_text(f"import sys\nsys.modules[{module!r}] = None\n")  # as if not installed
    env = {**subprocess_env(tmp_path), "PYTHONPATH": str(hidden)}
    missing = tmp_path / "no-such-snapshot.pt"  # refused before the snapshot is read: it need not exist
    result = subprocess.run(cli(["export", str(missing), str(tmp_path / "hf"), "--format", "hf"], script="snapshot.py"),
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert_one_error_line(result, re.escape(f"snapshot.py export --format hf needs the {module} package: "
                                            f"pip install -r requirements-hf.txt"))
    assert module in (PROJECT_DIR / "requirements-hf.txt").read_text() and not (tmp_path / "hf").exists()
