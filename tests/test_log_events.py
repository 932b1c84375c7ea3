"""Every structlog event the gateway emits is documented, with its level and every field, and
the documentation lists nothing the code no longer emits.

An operator greps the log at 3 a.m. by event name and field: a name or field missing from
``docs/operations.md`` ("## Audit log") is one they cannot know to look for. Read from the
source with ``ast`` (nothing runs), so an event on a path no test reaches counts too.

A call counts as an event when it is ``<logger>.debug|info|warning|error|exception|critical``
(or ``.log(level, ...)``), or a ``LogRecord(level, event, fields)`` the proxy emits later, and
its event argument is, or is resolved to, a dotted lower-case name (``claim.granted``). Names
built at run time are resolved where the source says what they can be: a conditional of two
literals, a lookup in a literal dict, an f-string over a parameter of the enclosing function
whose callers pass literals; any other f-string stands for the documented names it matches
(say ``task.<anything>``) that no other call emits by name, and the docs must list at least
one, each with the call's fields. Fields are the call's keywords and the literal keys of a
``**dict`` built in the same function; fields a ``**`` brings in from elsewhere are beyond
this test.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCES = ("gateway", "ledger", "adapters")
DOCS = REPO / "docs" / "operations.md"
SECTION = "## Audit log"

LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}
#: A logger method's level as the line shows it (``exception`` logs at error).
LEVEL_OF = {"exception": "error", "critical": "critical"}
EVENT_NAME = re.compile(r"[a-z][a-z0-9_]*(?:\.[a-z][a-z0-9_]*)+")
#: Keywords structlog renders under another name (``format_exc_info``).
RENDERED_AS = {"exc_info": "exception"}


@dataclass
class Site:
    """One place the code emits an event."""

    where: str
    #: The names it can emit; ``patterns``: regexes for names only known at run time.
    names: set[str] = field(default_factory=set)
    patterns: set[str] = field(default_factory=set)
    #: None when the level is only known at run time (``.log(record.levelno, ...)``).
    level: str | None = None
    fields: set[str] = field(default_factory=set)


# --- reading the code ---------------------------------------------------------------------


def _functions(tree: ast.Module) -> Iterator[tuple[ast.AST, ast.AST | None]]:
    """Every node with its innermost enclosing function (None at module level)."""

    def walk(node: ast.AST, func: ast.AST | None) -> Iterator[tuple[ast.AST, ast.AST | None]]:
        for child in ast.iter_child_nodes(node):
            inner = child if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else func
            yield child, inner
            yield from walk(child, inner)

    yield from walk(tree, None)


def _assigned(name: str, scope: ast.AST) -> list[ast.expr]:
    """The values ``name`` is assigned in ``scope`` (plain assignments only)."""
    found: list[ast.expr] = []
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign):
            if any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                found.append(node.value)
        elif (
            isinstance(node, ast.AnnAssign)
            and node.value is not None
            and isinstance(node.target, ast.Name)
            and node.target.id == name
        ):
            found.append(node.value)
    return found


def _literal_args(tree: ast.Module, func: ast.AST, param: str) -> set[str] | None:
    """The string literals the module's calls of ``func`` pass as its parameter ``param``;
    None when ``param`` is not one of its parameters or some call passes something else."""
    if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
        return None
    params = [a.arg for a in (*func.args.posonlyargs, *func.args.args)]
    if param not in params:
        return None
    index = params.index(param)
    values: set[str] = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if node.func.id != func.name:
            continue
        given = [k.value for k in node.keywords if k.arg == param]
        arg = given[0] if given else node.args[index] if index < len(node.args) else None
        if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
            return None
        values.add(arg.value)
    return values or None


def _names(expr: ast.expr, scope: ast.AST | None, tree: ast.Module) -> tuple[set[str], set[str]]:
    """The event names ``expr`` can be (names, regexes for run-time names)."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return ({expr.value}, set()) if EVENT_NAME.fullmatch(expr.value) else (set(), set())
    if isinstance(expr, ast.IfExp):
        a, b = _names(expr.body, scope, tree), _names(expr.orelse, scope, tree)
        return a[0] | b[0], a[1] | b[1]
    if isinstance(expr, ast.Subscript) and isinstance(expr.value, ast.Name):
        # A lookup in a module-level table of event names (``_PUT_EVENTS[outcome]``).
        tables = [v for v in _assigned(expr.value.id, tree) if isinstance(v, ast.Dict)]
        if tables:
            return _names(ast.Subscript(value=tables[0], slice=expr.slice), scope, tree)
    if isinstance(expr, ast.Subscript) and isinstance(expr.value, ast.Dict):
        names: set[str] = set()
        patterns: set[str] = set()
        for value in expr.value.values:
            got = _names(value, scope, tree)
            names, patterns = names | got[0], patterns | got[1]
        return names, patterns
    if isinstance(expr, ast.Name) and scope is not None:
        names, patterns = set(), set()
        for value in _assigned(expr.id, scope):
            got = _names(value, scope, tree)
            names, patterns = names | got[0], patterns | got[1]
        return names, patterns
    if isinstance(expr, ast.JoinedStr):
        return _fstring(expr, scope, tree)
    return set(), set()


def _fstring(
    expr: ast.JoinedStr, scope: ast.AST | None, tree: ast.Module
) -> tuple[set[str], set[str]]:
    fixed = "".join(str(v.value) for v in expr.values if isinstance(v, ast.Constant))
    if not re.fullmatch(r"[a-z0-9_.]*", fixed) or "." not in fixed:
        return set(), set()  # a message (``parser.error(f"...")``), not an event name
    parts: list[list[str] | str] = []  # alternatives for a resolved value, a regex otherwise
    for value in expr.values:
        if isinstance(value, ast.Constant):
            parts.append([str(value.value)])
        elif isinstance(value, ast.FormattedValue) and isinstance(value.value, ast.Name):
            literal = _literal_args(tree, scope, value.value.id) if scope else None
            parts.append(sorted(literal) if literal else "[a-z0-9_]+")
        else:
            parts.append("[a-z0-9_]+")
    if all(isinstance(p, list) for p in parts):
        combos = [""]
        for p in parts:
            assert isinstance(p, list)
            combos = [c + alt for c in combos for alt in p]
        return {c for c in combos if EVENT_NAME.fullmatch(c)}, set()
    regex = "".join(
        "(?:" + "|".join(map(re.escape, p)) + ")" if isinstance(p, list) else p for p in parts
    )
    return set(), {regex}


def _dict_keys(
    expr: ast.expr, scope: ast.AST | None, seen: frozenset[str] = frozenset()
) -> set[str]:
    """The literal keys of a ``**`` argument built in the same function."""
    if isinstance(expr, ast.Dict):
        keys: set[str] = set()
        for key, value in zip(expr.keys, expr.values, strict=True):
            if key is None:
                keys |= _dict_keys(value, scope, seen)
            elif isinstance(key, ast.Constant) and isinstance(key.value, str):
                keys.add(key.value)
        return keys
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "dict":
        return {k.arg for k in expr.keywords if k.arg is not None}
    if isinstance(expr, ast.Name) and scope is not None and expr.id not in seen:
        keys = set()
        for value in _assigned(expr.id, scope):
            keys |= _dict_keys(value, scope, seen | {expr.id})
        for node in ast.walk(scope):  # fields.update(node=..., slot=...)
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "update"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == expr.id
            ):
                keys |= {k.arg for k in node.keywords if k.arg is not None}
        return keys
    return set()


def _site(node: ast.Call, scope: ast.AST | None, tree: ast.Module, where: str) -> Site | None:
    func = node.func
    level: str | None
    if isinstance(func, ast.Name) and func.id == "LogRecord" and len(node.args) >= 2:
        first = node.args[0]
        level = first.value if isinstance(first, ast.Constant) else None
        event, extra = node.args[1], node.args[2:]
        fields: set[str] = set()
        for arg in extra:
            fields |= _dict_keys(arg, scope)
    elif isinstance(func, ast.Attribute) and func.attr in LEVELS and node.args:
        level, event = LEVEL_OF.get(func.attr, func.attr), node.args[0]
        fields = set()
    elif isinstance(func, ast.Attribute) and func.attr == "log" and len(node.args) >= 2:
        level, event = None, node.args[1]
        fields = set()
    else:
        return None
    names, patterns = _names(event, scope, tree)
    if not names and not patterns:
        return None
    for keyword in node.keywords:
        if keyword.arg is None:
            fields |= _dict_keys(keyword.value, scope)
        else:
            fields.add(RENDERED_AS.get(keyword.arg, keyword.arg))
    if isinstance(func, ast.Attribute) and func.attr == "exception":
        fields.add("exception")
    return Site(where, names, patterns, level, fields)


def emitted() -> list[Site]:
    sites: list[Site] = []
    for folder in SOURCES:
        for path in sorted((REPO / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node, scope in _functions(tree):
                if isinstance(node, ast.Call):
                    where = f"{path.relative_to(REPO)}:{node.lineno}"
                    site = _site(node, scope, tree, where)
                    if site is not None:
                        sites.append(site)
    return sites


# --- reading the docs -----------------------------------------------------------------------


@dataclass
class Row:
    levels: set[str]
    fields: set[str]


def _section() -> str:
    text = DOCS.read_text()
    assert SECTION in text, f"{DOCS.name} has no {SECTION!r} section"
    body = text.split(SECTION, 1)[1]
    return body.split("\n## ", 1)[0]


def _tables(section: str) -> dict[str, list[list[str]]]:
    """Markdown tables of the section by their first header cell: rows of cells."""
    tables: dict[str, list[list[str]]] = {}
    current: list[list[str]] | None = None
    for line in section.splitlines():
        if not line.startswith("|"):
            current = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if current is None:
            current = tables.setdefault(cells[0].lower(), [])
        elif not set("".join(cells)) <= set("-: "):
            current.append(cells)
    return tables


def _ticked(cell: str) -> set[str]:
    return set(re.findall(r"`([^`]+)`", cell))


def documented() -> tuple[dict[str, Row], set[str]]:
    """The events table (``| event | level | when | fields |``) and the fields every line
    has (``| field | ... |``)."""
    tables = _tables(_section())
    assert "event" in tables, f"{SECTION} has no table whose first column is 'event'"
    assert "field" in tables, f"{SECTION} has no table of the fields every line has"
    rows: dict[str, Row] = {}
    for cells in tables["event"]:
        assert len(cells) == 4, f"{SECTION}: a row needs event | level | when | fields: {cells}"
        names = _ticked(cells[0])
        assert len(names) == 1, f"{SECTION}: one `event` per row: {cells[0]!r}"
        name = names.pop()
        assert name not in rows, f"{SECTION}: {name} is listed twice"
        levels = {level.strip() for level in cells[1].split(",")}
        rows[name] = Row(levels, _ticked(cells[3]))
    common = set().union(*(_ticked(cells[0]) for cells in tables["field"]))
    return rows, common


# --- the checks -----------------------------------------------------------------------------


def test_the_source_reading_finds_events() -> None:
    """The reading itself works: literal, conditional, dict-dispatched, f-string-built and
    ``LogRecord`` events are all found (else the checks below would pass on nothing)."""
    sites = emitted()
    names = set().union(*(s.names for s in sites))
    assert {"claim.granted", "commit.committed", "commit.replayed"} <= names
    assert {"effect.committed", "effect.unknown", "effect.prepared", "claim.rejected"} <= names
    prepared = [s for s in sites if "effect.prepared" in s.names]
    assert prepared and all("seq" in s.fields and "effect_id" in s.fields for s in prepared)
    assert {"task.created", "task.revised", "task.unchanged"} <= names


def test_every_event_the_code_emits_is_documented_with_its_fields() -> None:
    rows, common = documented()
    sites = emitted()
    named = set().union(*(s.names for s in sites))
    missing: list[str] = []
    for site in sites:
        matched = set(site.names)
        for pattern in site.patterns:
            found = {n for n in rows if re.fullmatch(pattern, n) and n not in named}
            if not found:
                missing.append(
                    f"{site.where}: no event matching {pattern!r} (a name built at run time) "
                    f"in the {SECTION} table of docs/operations.md"
                )
            matched |= found
        for name in sorted(matched):
            row = rows.get(name)
            if row is None:
                missing.append(
                    f"{site.where}: event {name!r} is not in the {SECTION} table of "
                    "docs/operations.md"
                )
                continue
            if site.level is not None and site.level not in row.levels:
                missing.append(
                    f"{site.where}: event {name!r} is logged at {site.level!r}; its row "
                    f"says {', '.join(sorted(row.levels))}"
                )
            for name_of_field in sorted(site.fields - row.fields - common):
                missing.append(
                    f"{site.where}: event {name!r} has field {name_of_field!r}, missing from "
                    f"its row in the {SECTION} table of docs/operations.md"
                )
    assert not missing, "\n".join(missing)


def test_the_docs_list_no_event_the_code_does_not_emit() -> None:
    rows, _ = documented()
    sites = emitted()
    names = set().union(*(s.names for s in sites))
    patterns = set().union(*(s.patterns for s in sites))
    stale = sorted(
        name
        for name in rows
        if name not in names and not any(re.fullmatch(p, name) for p in patterns)
    )
    assert not stale, (
        f"docs/operations.md {SECTION} lists events no code under {', '.join(SOURCES)} emits: "
        + ", ".join(stale)
    )


def test_every_line_field_is_documented() -> None:
    """The fields the renderer adds to every line (gateway/logs.py) are in the table of
    fields every line has."""
    _, common = documented()
    source = (REPO / "gateway" / "logs.py").read_text()
    added = set(re.findall(r'key="([a-z_]+)"', source))  # TimeStamper(key="ts")
    added |= {"event", "level"}  # structlog's event name; add_log_level
    assert added <= common, f"not in the {SECTION} fields table: {sorted(added - common)}"


def test_every_event_of_a_real_run_is_documented_with_its_fields(tmp_path: Path) -> None:
    """What reading the source cannot see (fields a ``**`` brings in from elsewhere, names
    built at run time): ``fencegate demo --keep`` runs a real gateway through claims, lost
    answers, replays, an operator's resolve and an epoch bump, and keeps the gateway's log.
    Every line of it must be a documented event, at a documented level, with only documented
    fields."""
    script = (
        "import asyncio, sys\n"
        "from fencegate.gateway.demo_stories import run_demo\n"
        "sys.exit(asyncio.run(run_demo(keep=True)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    logs = list(tmp_path.glob("fencegate-demo-*/gateway.log"))
    assert len(logs) == 1, done.stdout
    rows, common = documented()
    seen: set[str] = set()
    missing: list[str] = []
    for line in logs[0].read_text().splitlines():
        record = json.loads(line)
        name, level = record["event"], record["level"]
        seen.add(name)
        row = rows.get(name)
        if row is None:
            missing.append(f"event {name!r} is not in the {SECTION} table: {line}")
            continue
        if level not in row.levels:
            missing.append(f"event {name!r} is logged at {level!r}; its row says {row.levels}")
        for extra in sorted(set(record) - row.fields - common):
            missing.append(f"event {name!r} has field {extra!r}, missing from its row")
    assert not missing, "\n".join(sorted(set(missing)))
    # The run went through the gateway's decisions, not around them.
    assert {
        "store.opened", "task.created", "claim.granted", "claim.rejected", "renew.rejected",
        "effect.prepared", "effect.committed", "effect.unknown", "effect.replayed",
        "effect.fenced", "effect.rejected", "commit.committed", "commit.rejected",
        "operator.resolve", "claims.paused", "epoch.bumped",
    } <= seen, sorted(seen)  # fmt: skip
