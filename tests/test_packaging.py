"""What ``pip install fencegate`` puts into site-packages: one import package, ``fencegate``.

The repository keeps a folder per layer (``gateway/``, ``ledger/``, ``adapters/``) and maps
them into ``fencegate.*`` with setuptools' package-dir; a generic top-level name would clash
with other distributions (``ledger`` and ``adapters`` exist on the package index).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    """The wheel built from a copy of the tracked files (the build writes into its source)."""
    work = tmp_path_factory.mktemp("wheel")
    tracked = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    source = work / "src"
    for name in filter(None, tracked):
        if not (REPO / name.decode()).is_file():
            continue  # deleted in the working tree
        target = source / name.decode()
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name.decode(), target)
    out = work / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(out), str(source)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    (built,) = out.glob("fencegate-*.whl")
    return zipfile.ZipFile(built)


def test_the_wheel_installs_one_import_package(wheel: zipfile.ZipFile) -> None:
    top = {name.split("/", 1)[0] for name in wheel.namelist()}
    packages = {name for name in top if not name.endswith(".dist-info")}
    assert packages == {"fencegate"}


def test_the_wheel_holds_every_layer_and_its_data(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    for needed in (
        "fencegate/__init__.py",
        "fencegate/py.typed",
        "fencegate/gateway/cli.py",
        "fencegate/gateway/proxy.py",
        "fencegate/ledger/effects.py",
        "fencegate/ledger/lua/prepare.lua",
        "fencegate/ledger/lua/common.lua",
        "fencegate/adapters/base.py",
        # The console works offline: its templates and assets ship in the package.
        "fencegate/gateway/console/views.py",
        "fencegate/gateway/console/templates/base.html",
        "fencegate/gateway/console/templates/queue.html",
        "fencegate/gateway/console/static/console.css",
        "fencegate/gateway/console/static/console.js",
        "fencegate/gateway/console/static/favicon.svg",
    ):
        assert needed in names, needed
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "fencegate = fencegate.gateway.cli:main" in wheel.read(entry_points).decode()
