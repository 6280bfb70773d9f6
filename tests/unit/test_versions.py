"""The supported range is declared once (pyproject.toml) and kept: the pinned ends CI installs lie inside it, the
file for a machine with its own torch states the same ranges, and compat.py's bounds are the declaration's.

What is installed is declared once too: pyproject.toml's dependencies are what the project's code imports (what
`make run` installs, requirements.txt, nothing more), each extra is a requirements file of its own that pins exactly
its packages, requirements-test.txt pulls in every extra beside the test tools, the refusals name those files, and
the README's install lines say the same."""

import ast
import re
import sys
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version
from support import project_modules

from mingpt import PROJECT_DIR, compat
from mingpt.checkpoint import hf_export
from mingpt.reporting import trackers

tomllib = pytest.importorskip("tomllib")
pytestmark = pytest.mark.oldest_torch


def project() -> dict:
    return tomllib.loads((PROJECT_DIR / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def by_package(lines: list[str]) -> dict[str, SpecifierSet]:
    return {canonicalize_name(r.name): r.specifier for r in map(Requirement, lines)}


def declared() -> dict[str, SpecifierSet]:
    return by_package(project()["dependencies"])


def extras() -> dict[str, dict[str, SpecifierSet]]:
    """pyproject.toml's extras: name -> their packages' ranges."""
    return {name: by_package(lines) for name, lines in project()["optional-dependencies"].items()}


def lines(name: str) -> list[str]:
    """A requirements file's lines, comments left out."""
    found = [line.split(" #")[0].strip() for line in (PROJECT_DIR / name).read_text(encoding="utf-8").splitlines()]
    return [line for line in found if line and not line.startswith("#")]


def requirements(name: str) -> dict[str, SpecifierSet]:
    """A requirements file's own lines (not the files it includes), by package."""
    return by_package([line for line in lines(name) if not line.startswith("-r")])


def includes(name: str) -> list[str]:
    """The files a requirements file includes (-r FILE)."""
    return [line.removeprefix("-r").strip() for line in lines(name) if line.startswith("-r")]


def extra_file(extra: str) -> str:
    return f"requirements-{extra}.txt"


def pinned(specifier: SpecifierSet) -> Version:
    (only,) = list(specifier)
    assert only.operator == "==", specifier
    return Version(only.version)


@pytest.mark.parametrize("name", ["requirements.txt", "requirements-oldest.txt"])
def test_each_pinned_end_lies_in_the_declared_range(name):
    ranges, pins = declared(), requirements(name)
    assert set(ranges) <= set(pins), f"{name} misses {set(ranges) - set(pins)}"
    for package, specifier in pins.items():
        if package in ranges and any(s.operator == "==" for s in specifier):
            assert ranges[package].contains(pinned(specifier), prereleases=True), (name, package, specifier)


def test_the_oldest_leg_installs_the_oldest_torch_hydra_and_omegaconf():
    ranges, oldest = declared(), requirements("requirements-oldest.txt")
    for package in ("torch", "hydra-core", "omegaconf", "numpy"):
        floor = next(Version(s.version) for s in ranges[package] if s.operator == ">=")
        assert pinned(oldest[package]).release[:len(floor.release)] == floor.release, package
    assert compat.OLDEST_TORCH == pinned(oldest["torch"]).release[:2] <= (2, 6)


def test_the_file_for_a_machine_with_its_own_torch_states_the_declared_ranges():
    assert requirements("requirements-without-torch.txt") == {k: v for k, v in declared().items() if k != "torch"}


def test_compat_knows_the_declared_torch_range_and_this_torch_is_in_it():
    torch_range = declared()["torch"]
    upper = next(Version(s.version) for s in torch_range if s.operator == "<")
    assert Version(".".join(map(str, compat.NEWEST_TORCH))) < upper
    assert Version(".".join(map(str, compat.NEWEST_TORCH + (99,)))) in torch_range
    assert Version(re.match(r"[\d.]+", torch.__version__).group().rstrip(".")) in torch_range


def test_the_readme_states_the_range():
    readme = (PROJECT_DIR / "README.md").read_text(encoding="utf-8")
    oldest, newest = (".".join(map(str, v)) for v in (compat.OLDEST_TORCH, compat.NEWEST_TORCH))
    assert f"torch {oldest} to {newest}" in readme
    assert "pip install -r requirements-without-torch.txt" in readme
    assert Path(PROJECT_DIR / "requirements-oldest.txt").is_file()


# ---------------------------------------------------------------------------- what is installed, and by what
# A module the code imports that is not its distribution's name, or that another dependency brings
DISTRIBUTION = {"hydra": "hydra-core", "mlflow": "mlflow-skinny", "botocore": "s3fs"}  # botocore: s3fs's aiobotocore
# A dependency loaded by another by name, never imported by the project's code
LOADED = {"s3fs": "fsspec, for s3:// URLs"}
# The only modules that may import an extra's packages: each on first use, inside a function
OPTIONAL_USERS = {"hf": {"mingpt/checkpoint/hf_export.py", "mingpt/data/tokenizer.py"},
                  "mlflow": {"mingpt/reporting/trackers.py"}, "wandb": {"mingpt/reporting/trackers.py"},
                  "tensorboard": set()}


def imported_distributions() -> dict[str, set[str]]:
    """Every package the project's code (not the tests') imports, anywhere in a module: distribution -> modules."""
    local = {path.stem for path in PROJECT_DIR.glob("*.py")} | {"mingpt", "benchmarks", "slurm"}
    found: dict[str, set[str]] = {}
    for path in project_modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for top in {name.split(".")[0] for name in names} - local - set(sys.stdlib_module_names):
                distribution = canonicalize_name(DISTRIBUTION.get(top, top))
                found.setdefault(distribution, set()).add(str(path.relative_to(PROJECT_DIR)))
    return found


def test_a_run_installs_what_the_code_imports_and_nothing_more():
    """`make run` installs requirements.txt alone, which pins exactly pyproject.toml's dependencies: what the code
    imports, apart from the extras (imported only by their own modules). TensorBoard is an extra: the runs write its
    event files themselves (mingpt/reporting/tensorboard_events.py)."""
    imported, optional = imported_distributions(), {package for extra in extras().values() for package in extra}
    assert set(declared()) == (set(imported) - optional) | set(LOADED)
    assert set(requirements("requirements.txt")) == set(declared()) and includes("requirements.txt") == []
    for extra, packages in extras().items():
        for package in set(packages) & set(imported):
            assert imported[package] <= OPTIONAL_USERS[extra], (package, imported[package])
    makefile = (PROJECT_DIR / "Makefile").read_text(encoding="utf-8")
    run_install = re.search(r"^\$\(VENV\)/\.installed-run:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    installs = r"pip install \$\(INSTALL_FLAGS\) (.*)"  # INSTALL_FLAGS: pip's own options (.ci/run: --no-compile)
    assert re.findall(installs, run_install) == ["-r requirements.txt"]
    assert re.search(r"^install: \$\(VENV\)/\.installed-run$", makefile, re.M)
    assert re.search(r"^run: install$", makefile, re.M) and re.search(r"^test: install-test$", makefile, re.M)
    test_install = re.search(r"^\$\(VENV\)/\.installed-test:.*\n((?:\t.*\n)+)", makefile, re.M).group(1)
    assert re.findall(installs, test_install) == ["-r requirements.txt -r requirements-test.txt"]


def test_each_extra_is_a_requirements_file_that_pins_its_packages_in_the_declared_range():
    for extra, ranges in extras().items():
        pins = requirements(extra_file(extra))
        assert set(pins) == set(ranges) and includes(extra_file(extra)) == [], extra
        for package, specifier in pins.items():
            assert ranges[package].contains(pinned(specifier), prereleases=True), (extra, package, specifier)
    on_disk = {path.name for path in PROJECT_DIR.glob("requirements-*.txt")}
    assert on_disk == {*map(extra_file, extras()), "requirements-test.txt", "requirements-oldest.txt",
                       "requirements-without-torch.txt"}


def test_the_tests_install_every_extra_and_the_oldest_legs_the_same_tools_without_them():
    assert sorted(includes("requirements-test.txt")) == sorted(map(extra_file, extras()))
    tools = requirements("requirements-test.txt")
    assert {"pytest", "moto", "boto3", "ruff"} <= set(tools)
    assert not set(tools) & (set(declared()) | {package for extra in extras().values() for package in extra})
    oldest = requirements("requirements-oldest.txt")
    assert includes("requirements-oldest.txt") == [] and {k: oldest[k] for k in tools.keys() & oldest} == tools
    assert set(oldest) == set(declared()) | set(tools)  # the run's packages at their oldest, the tools, no extra
    assert [line for line in lines("requirements-oldest.txt") if line.startswith("moto")] == \
           [line for line in lines("requirements-test.txt") if line.startswith("moto")]  # with moto's [server]


def test_each_refusal_names_the_file_that_installs_what_is_missing():
    """A missing optional package stops its command in one line with the project's install command
    (tests/e2e/test_trackers.py and tests/e2e/test_extras.py see the lines themselves)."""
    # tiktoken: an accelerator of the BPE's encoding (mingpt/data/tokenizer.py FastBpe); the export does not need it
    assert set(requirements(hf_export.REQUIREMENTS)) == set(hf_export.PACKAGES) | {"tiktoken"} == set(extras()["hf"])
    for switch, (module, name) in trackers.PACKAGES.items():
        assert name == extra_file(switch) and canonicalize_name(DISTRIBUTION.get(module, module)) in requirements(name)
    assert {canonicalize_name(module) for module in trackers.MLFLOW_SQL} <= set(requirements(extra_file("mlflow")))


def test_the_readme_says_what_make_run_installs_and_how_to_add_each_extra():
    readme = (PROJECT_DIR / "README.md").read_text(encoding="utf-8")
    install = readme[readme.index("## Install"):readme.index("\n## ", readme.index("## Install") + 1)]
    assert "`make run`" in install and "`requirements.txt`" in install and "`requirements-test.txt`" in install
    assert "pip install -r requirements.txt" in install
    for extra in extras():
        assert f"pip install -r {extra_file(extra)}" in install, extra
    named = {name for doc in [PROJECT_DIR / "README.md", *PROJECT_DIR.glob("docs/*.md")]
             for name in re.findall(r"requirements[\w-]*\.txt", doc.read_text(encoding="utf-8"))}
    assert {name for name in named if not (PROJECT_DIR / name).is_file()} == set()  # e.g. a file since removed
