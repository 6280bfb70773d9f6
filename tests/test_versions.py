"""The supported range is declared once (pyproject.toml) and kept: the pinned ends CI installs lie inside it, the
file for a machine with its own torch states the same ranges, and compat.py's bounds are the declaration's."""

import re
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from mingpt import PROJECT_DIR, compat

tomllib = pytest.importorskip("tomllib")
pytestmark = pytest.mark.oldest_torch


def declared() -> dict[str, SpecifierSet]:
    project = tomllib.loads((PROJECT_DIR / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return {canonicalize_name(r.name): r.specifier for r in map(Requirement, project["dependencies"])}


def requirements(name: str) -> dict[str, SpecifierSet]:
    """A requirements file's own lines (not the files it includes), by package."""
    found = {}
    for line in (PROJECT_DIR / name).read_text(encoding="utf-8").splitlines():
        line = line.split(" #")[0].strip()
        if line and not line.startswith(("#", "-r")):
            requirement = Requirement(line)
            found[canonicalize_name(requirement.name)] = requirement.specifier
    return found


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
