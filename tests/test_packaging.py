"""Packaging (issue 20): the wheel installs one top-level package, `probe`, with every module and data file of the
three folders it is built from (cli/ as probe.cli, reports/ as probe.reports), under a distribution name of its
own and complete metadata; a second checkout beside the installed one is refused in one line. `.ci/wheel` installs
the built wheel into a fresh environment and runs commands from it."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
VERSION = re.search(r'^version = "(.+?)"', PYPROJECT, re.M)[1]  # type: ignore[index]
DIST_INFO = f"probe_heads-{VERSION}.dist-info"
FOLDERS = {"probe": "probe", "cli": "probe/cli", "reports": "probe/reports"}  # in the repository -> in the wheel


def source_files() -> set[str]:
    """Where each file of the three folders belongs in the wheel (compiled files aside)."""
    return {f"{FOLDERS[folder]}/{path.relative_to(ROOT / folder).as_posix()}" for folder in FOLDERS
            for path in (ROOT / folder).rglob("*") if path.is_file() and "__pycache__" not in path.parts}


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of what a wheel is built from: a second checkout, away from the one that is installed."""
    copy = tmp_path_factory.mktemp("checkout")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, copy / name)
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, copy / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


@pytest.fixture(scope="module")
def wheel(checkout: Path) -> Iterator[zipfile.ZipFile]:
    """The wheel that `python -m build` makes of the checkout (the build tools already installed: no download)."""
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", "dist", "."], cwd=checkout,
                   check=True, capture_output=True, timeout=300)
    (built,) = (checkout / "dist").glob("*.whl")
    with zipfile.ZipFile(built) as archive:
        yield archive


def test_the_wheel_has_one_top_level_package(wheel: zipfile.ZipFile) -> None:
    assert {name.split("/")[0] for name in wheel.namelist()} == {"probe", DIST_INFO}


def test_the_wheel_has_every_module_and_data_file(wheel: zipfile.ZipFile) -> None:
    packaged = {name for name in wheel.namelist() if name.startswith("probe/")}
    assert packaged == source_files()
    assert {"probe/inputs/english.txt", "probe/reports/assets/probe.js", "probe/cli/__main__.py"} <= packaged


def test_the_wheel_metadata_names_the_distribution_its_license_and_the_command(wheel: zipfile.ZipFile) -> None:
    fields = Parser().parsestr(wheel.read(f"{DIST_INFO}/METADATA").decode())
    assert (fields["Name"], fields["Version"]) == ("probe-heads", VERSION)
    assert fields["License-Expression"] == "MIT" and fields["License-File"] == "LICENSE"
    assert wheel.read(f"{DIST_INFO}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
    assert {"Homepage", "Source", "Issues"} <= {url.split(",")[0] for url in fields.get_all("Project-URL")}
    assert "Intended Audience :: Science/Research" in fields.get_all("Classifier")
    assert "probe = probe.cli.app:main" in wheel.read(f"{DIST_INFO}/entry_points.txt").decode()


@pytest.mark.slow
def test_a_second_checkout_is_refused_in_one_line(checkout: Path) -> None:
    """From a checkout's root, probe is its probe/ folder (the cwd comes first on sys.path), while probe.cli comes
    from the installed checkout (this repository): the mix is refused in one line naming both, never run."""
    code = "import probe.cli.app"
    completed = subprocess.run([sys.executable, "-c", code], cwd=checkout, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 1
    last = completed.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ImportError: probe is {checkout / 'probe'} but probe.cli is ")
    assert "pip install -e ." in last
