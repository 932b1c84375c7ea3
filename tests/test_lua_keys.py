"""The Lua scripts build keys only from the layout rendered from ``ledger/keys.py``.

``keys.lua_key_helpers`` renders every key of ``Keys`` as Lua (``K.<name>``), and
``redis_store.load_script_source`` puts it before ``task_lib.lua``; the effect steps' function
library (``redis_store.library_source``) has no layout and builds no key. These fail on a key of
``keys.py`` the Lua lacks or renders wrong, on a ``K.<name>`` a script uses that ``keys.py``
no longer has (renamed or dropped: nil at run time), and on a Lua file that builds a key
from its literal parts by hand again.
"""

from __future__ import annotations

import re
from pathlib import Path

import redis

from fencegate.ledger import keys
from fencegate.ledger.keys import NOT_KEYS, Keys, key_names, lua_key_helpers
from fencegate.ledger.redis_store import _FUNCTIONS, _SCRIPTS, library_source, load_script_source
from tests.servers import RedisServer

LUA = Path(keys.__file__).resolve().parent / "lua"


def _code(path: Path) -> str:
    """A Lua file without its comments (``--`` to the end of the line)."""
    return "\n".join(line.split("--", 1)[0] for line in path.read_text().splitlines())


def test_every_member_of_keys_is_a_rendered_key_or_named_as_none() -> None:
    public = {name for name in vars(Keys) if not name.startswith("_")}
    assert public == set(key_names()) | NOT_KEYS
    rendered = set(re.findall(r"^(?:function )?K\.(\w+)", lua_key_helpers(), re.MULTILINE))
    assert rendered == set(key_names())


def test_every_key_a_script_uses_is_in_keys_py() -> None:
    used = {
        (path.name, name)
        for path in LUA.glob("*.lua")
        for name in re.findall(r"\bK\.(\w+)", _code(path))
    }
    assert used, "no script uses K: the scan is broken"
    missing = sorted(f"{script}: K.{name}" for script, name in used if name not in key_names())
    assert not missing, missing


def test_every_script_that_uses_k_gets_it() -> None:
    """A script (or library) that uses ``K`` is loaded after the rendered layout: before
    ``task_lib.lua``, or alone (the library name ``keys``) for a script without it."""
    for name, libraries in _SCRIPTS.items():
        files = ["common", *(part for part in libraries if part != "keys"), name]
        if any(re.search(r"\bK\.", _code(LUA / f"{part}.lua")) for part in files):
            assert "task_lib" in libraries or "keys" in libraries, name
            source = load_script_source(name)
            first_use = min(
                source.index(text)
                for text in ("local task_key", (LUA / f"{name}.lua").read_text())
                if text in source
            )
            assert source.index(lua_key_helpers()) < first_use, name


def test_the_function_library_builds_no_key() -> None:
    """The effect steps run as functions of one library (``library_source``), which has no
    key layout (it would need the prefix of each call): none of its scripts or libraries uses
    ``K``, so every key they touch comes in KEYS, built by ``ledger.keys``."""
    library = library_source()
    assert "local K = {}" not in library.source
    for name in _FUNCTIONS:
        for part in ("common", *_SCRIPTS[name], name):
            assert part not in ("task_lib", "keys"), name
            assert not re.search(r"\bK\.", _code(LUA / f"{part}.lua")), f"{name}: {part}.lua"


def test_no_lua_file_builds_a_key_by_hand() -> None:
    """The literal parts of every key (``':{'``, ``'}:task'``, ``':effects:prepared'``...)
    appear in no script's code: a key is built with ``K`` only."""
    pieces = set(re.findall(r"'((?:[^'\\]|\\.)*)'", lua_key_helpers()))
    assert "}:task" in pieces and ":events" in pieces
    found = sorted(
        f"{path.name}: '{piece}'"
        for path in LUA.glob("*.lua")
        for piece in pieces
        if f"'{piece}'" in _code(path) or f'"{piece}"' in _code(path)
    )
    assert not found, found


def test_the_rendered_keys_are_the_python_keys_in_redis(redis_server: RedisServer) -> None:
    """Run in Redis's own Lua: each ``K.<name>`` is ``Keys.<name>``, for a prefix and an id
    with the characters Lua strings and patterns treat specially."""
    prefix, arg = "fg-t%1'\\[x]", "t-1.%'"
    names = key_names()
    program = lua_key_helpers() + "return {" + ", ".join(
        f"K.{name}" if isinstance(vars(Keys)[name], property) else f"K.{name}(ARGV[3])"
        for name in names
    ) + "}"  # fmt: skip
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    try:
        got = client.eval(program, 0, "clock", prefix, arg)
    finally:
        client.close()
    python = Keys(prefix=prefix)
    expected = [
        getattr(python, name) if isinstance(vars(Keys)[name], property) else
        getattr(python, name)(arg)
        for name in names
    ]  # fmt: skip
    assert got == expected
