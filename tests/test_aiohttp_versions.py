"""``tests/test_send_once.py`` on every aiohttp minor version pyproject.toml allows (slow).

The guard against aiohttp's own re-send (``gateway.http_client.send_once``) rests on aiohttp
internals that change between releases: which methods it re-sends, and that a per-request
client middleware is called again for the re-send. So for each minor version the pin allows,
the newest patch release is installed on its own (``pip install --no-deps --target``) and the
send-once tests run in a subprocess whose PYTHONPATH puts that aiohttp in front of the
venv's. The subprocess is checked to have imported exactly that version, twice: by a
``python -c`` under the same environment, and by ``FENCEGATE_EXPECT_AIOHTTP``, which
``test_the_installed_aiohttp_is_the_one_under_test`` asserts inside the run.

Needs the package index; when pip cannot reach it the test fails and says so.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1_200)]

ROOT = Path(__file__).resolve().parents[1]
#: The first aiohttp with (public) client middlewares, which ``send_once`` is.
MIDDLEWARES_SINCE = (3, 12)
PIP_TIMEOUT_S = 300
SUITE_TIMEOUT_S = 600

Release = tuple[int, ...]


def aiohttp_requirement() -> str:
    """The ``aiohttp`` entry of ``[project] dependencies`` in pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for dependency in project["dependencies"]:
        if re.match(r"aiohttp\s*(?:[<>=!~;\[(]|$)", dependency, re.IGNORECASE):
            return str(dependency)
    raise AssertionError("pyproject.toml: no aiohttp in [project] dependencies")


def _release(text: str) -> Release | None:
    """``3.12.15`` -> (3, 12, 15); None for anything but a plain final release."""
    if not re.fullmatch(r"\d+(\.\d+)*", text):
        return None
    return tuple(int(part) for part in text.split("."))


def _compare(a: Release, b: Release) -> int:
    width = max(len(a), len(b))
    pa, pb = a + (0,) * (width - len(a)), b + (0,) * (width - len(b))
    return (pa > pb) - (pa < pb)


def _fallback_allows(requirement: str) -> Callable[[str], bool]:
    """A small specifier parser for when ``packaging`` is missing: comma-separated clauses of
    >= > <= < == != with plain release numbers (what this pin uses)."""
    spec = re.sub(r"^aiohttp(\[[^\]]*\])?", "", requirement.split(";")[0].strip()).strip("() ")
    clauses = []
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        match = re.fullmatch(r"(>=|<=|==|!=|>|<)\s*(\d+(?:\.\d+)*)", clause)
        if match is None:
            raise AssertionError(f"pyproject.toml: cannot read aiohttp clause {clause!r}")
        clauses.append((match[1], _release(match[2])))
    tests = {
        ">=": lambda c: c >= 0,
        ">": lambda c: c > 0,
        "<=": lambda c: c <= 0,
        "<": lambda c: c < 0,
        "==": lambda c: c == 0,
        "!=": lambda c: c != 0,
    }

    def allows(version: str) -> bool:
        release = _release(version)
        if release is None:
            return False
        return all(tests[op](_compare(release, bound)) for op, bound in clauses if bound)

    return allows


def version_filter(requirement: str) -> Callable[[str], bool]:
    """Does the pin allow this version (final releases only)?"""
    try:
        from packaging.requirements import Requirement
        from packaging.version import InvalidVersion, Version
    except ImportError:
        return _fallback_allows(requirement)
    specifier = Requirement(requirement).specifier

    def allows(version: str) -> bool:
        try:
            parsed = Version(version)
        except InvalidVersion:
            return False
        return not parsed.is_prerelease and parsed in specifier

    return allows


def allowed_minors(requirement: str) -> list[tuple[int, int]]:
    """The minor versions the pin allows, from the pin alone (no index): every X.Y from the
    lower bound's minor up to the upper bound's for which some X.Y.Z passes the pin."""
    bounds = re.findall(r"(>=|<=|==|>|<)\s*(\d+(?:\.\d+)*)", requirement)
    lows = [_release(v) for op, v in bounds if op in (">=", ">", "==")]
    highs = [_release(v) for op, v in bounds if op in ("<=", "<", "==")]
    if not lows or not highs:
        raise AssertionError(f"pyproject.toml: {requirement!r} needs a lower and an upper bound")
    low, high = max(filter(None, lows)), min(filter(None, highs))
    allows = version_filter(requirement)
    minors = []
    for major in range(low[0], high[0] + 1):
        first = low[1] if major == low[0] and len(low) > 1 else 0
        last = high[1] if major == high[0] and len(high) > 1 else 99
        for minor in range(first, last + 1):
            if any(allows(f"{major}.{minor}.{patch}") for patch in range(100)):
                minors.append((major, minor))
    return minors


REQUIREMENT = aiohttp_requirement()
MINORS = allowed_minors(REQUIREMENT)


@cache
def index_listing() -> tuple[tuple[str, ...], str]:
    """Every aiohttp version the package index lists, through pip (as a developer would)."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "index", "versions", "aiohttp",
             "--disable-pip-version-check", "--no-input"],
            capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"pip index versions aiohttp: no answer from the package index within "
                    f"{PIP_TIMEOUT_S} s; these tests need it")  # fmt: skip
    match = re.search(r"^Available versions:\s*(.+)$", done.stdout, re.MULTILINE)
    if done.returncode != 0 or match is None:
        pytest.fail(
            "pip index versions aiohttp: could not list aiohttp from the package index "
            f"(exit {done.returncode}); these tests need it.\n"
            f"stdout:\n{done.stdout}\nstderr:\n{done.stderr}"
        )
    return tuple(v.strip() for v in match[1].split(",")), done.stderr


def newest_patch(major: int, minor: int) -> str:
    allows = version_filter(REQUIREMENT)
    listed, warnings = index_listing()
    candidates = [v for v in listed if v.startswith(f"{major}.{minor}.") and allows(v)]
    if not candidates:
        released = [r for r in map(_release, listed) if r is not None]
        if released and (major, minor) > max(released)[:2]:
            # An open upper bound (say <4) allows minors that do not exist yet.
            pytest.skip(f"aiohttp {major}.{minor} is not released yet")
        pytest.fail(
            f"the package index lists no aiohttp {major}.{minor}.x that {REQUIREMENT!r} allows "
            f"(pip listed {', '.join(listed)}); is the package index reachable? pip said:\n"
            f"{warnings}"
        )
    return max(candidates, key=lambda v: _release(v) or ())


def test_the_pin_allows_only_aiohttp_with_client_middlewares() -> None:
    assert MINORS, f"{REQUIREMENT!r} allows no aiohttp minor version"
    assert MINORS[0] >= MIDDLEWARES_SINCE, (
        f"{REQUIREMENT!r} allows aiohttp {MINORS[0]}: send_once() needs client middlewares "
        f"(aiohttp >= {'.'.join(map(str, MIDDLEWARES_SINCE))})"
    )


@pytest.mark.parametrize("major_minor", MINORS, ids=[f"aiohttp-{a}.{b}" for a, b in MINORS])
def test_send_once_holds_on_each_allowed_aiohttp(
    major_minor: tuple[int, int], tmp_path: Path
) -> None:
    major, minor = major_minor
    version = newest_patch(major, minor)
    target = tmp_path / f"aiohttp-{major}.{minor}"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target),
         "--disable-pip-version-check", "--no-input", "--quiet", f"aiohttp=={version}"],
        capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False,
    )  # fmt: skip
    if install.returncode != 0:
        pytest.fail(
            f"pip install aiohttp=={version}: failed (exit {install.returncode}); is the "
            f"package index reachable?\nstdout:\n{install.stdout}\nstderr:\n{install.stderr}"
        )

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(target), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    )
    env["FENCEGATE_EXPECT_AIOHTTP"] = version
    which = "import aiohttp; print(aiohttp.__version__); print(aiohttp.__file__)"
    probe = subprocess.run(
        [sys.executable, "-c", which],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=60, check=False,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr
    imported, where = probe.stdout.split()
    assert imported == version, f"PYTHONPATH={target} imported aiohttp {imported} ({where})"
    assert Path(where).resolve().is_relative_to(target.resolve()), where

    suite = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/test_send_once.py", "-q", "-p", "no:cacheprovider"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=SUITE_TIMEOUT_S, check=False,
    )  # fmt: skip
    summary = suite.stdout.strip().splitlines()[-1] if suite.stdout.strip() else "(no output)"
    print(f"aiohttp {version} from {where}: {summary}")
    assert suite.returncode == 0, (
        f"tests/test_send_once.py fails on aiohttp {version}:\n{suite.stdout[-20_000:]}\n"
        f"{suite.stderr[-5_000:]}"
    )
    assert re.search(r"\b\d+ passed\b", summary) and "failed" not in summary, summary
