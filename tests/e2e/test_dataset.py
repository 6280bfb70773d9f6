"""The data layer as another user (setpriv, from root): a folder of the corpus that cannot be listed is named, never
left out (the rest of the data layer, in one process: tests/unit/test_dataset.py)."""

import os
from pathlib import Path

import pytest
from support import PROJECT_DIR, text_files


def test_an_unreadable_folder_among_many_is_named_not_left_out():
    """As another user (setpriv, from root): a folder of the corpus that cannot be listed stops the job in one
    line, for a folder and for a glob, instead of its files quietly missing from the corpus."""
    import shutil
    import subprocess
    import sys
    import tempfile

    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c"]
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv")
    if subprocess.run([*as_nobody, "import numpy, fsspec"], capture_output=True).returncode != 0:
        pytest.skip("this Python cannot run as another user here")
    base = Path(tempfile.mkdtemp(prefix="mingpt-unreadable-"))
    try:
        text_files(base / "corpus", {"a/1.txt": "readable " * 10, "b/2.txt": "hidden from nobody " * 10})
        os.system(f"chmod -R a+rX {base}")
        (base / "corpus" / "b").chmod(0)
        script = (f"import sys; sys.path.insert(0, {str(PROJECT_DIR)!r}); from mingpt.data import token_cache; "
                  f"from mingpt.errors import UsageError\n"
                  f"for where in sys.argv[1:]:\n"
                  f"    try: print('listed', token_cache.list_sources(where))\n"
                  f"    except UsageError as e: print(e)")
        result = subprocess.run([*as_nobody, script, str(base / "corpus"), f"{base}/corpus/*/*.txt"],
                                capture_output=True, text=True, timeout=60)
        lines = result.stdout.splitlines()
        assert len(lines) == 2 and all(f"cannot read data file {base}/corpus/b: PermissionError" in line
                                       for line in lines), result.stdout + result.stderr
    finally:
        (base / "corpus" / "b").chmod(0o755)
        shutil.rmtree(base)
