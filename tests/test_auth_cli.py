"""``[auth]`` from the command line: ``fencegate token new``, config errors that name the key,
and the operator CLI's ``--token-file`` / ``$FENCEGATE_TOKEN`` against a gateway with auth."""

from __future__ import annotations

import asyncio
import hashlib
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import structlog
from aiohttp.test_utils import TestClient, TestServer

from fencegate.gateway.app import create_app
from fencegate.gateway.auth import token_sha256
from fencegate.gateway.cli import main
from fencegate.gateway.config import Config, ConfigError, load_config
from tests.conftest import build_test_store, make_config

OPERATOR_TOKEN = "tok-operator-cli-0123456789"
OBSERVER_TOKEN = "tok-observer-cli-0123456789"


def test_token_new_prints_a_token_and_the_lines_that_admit_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["token", "new", "--name", "worker-1", "--role", "worker",
                 "--role", "observer", "--role", "worker"]) == 0  # fmt: skip
    out, err = capsys.readouterr()
    token = err.strip().splitlines()[-1]
    assert len(token) >= 43 and token not in out  # 32 random bytes; never on stdout
    lines = tomllib.loads(out)
    (principal,) = lines["auth"]["principals"]
    assert principal == {
        "name": "worker-1",
        "roles": ["worker", "observer"],
        "token_sha256": hashlib.sha256(token.encode()).hexdigest(),
    }
    # The printed lines are a valid [auth] section as they stand.
    assert Config.model_validate(lines).auth is not None
    assert main(["token", "new", "--name", "worker-1", "--role", "worker"]) == 0
    assert capsys.readouterr().err.strip().splitlines()[-1] != token


@pytest.mark.parametrize(
    "argv",
    [
        ["token", "new", "--name", "worker 1", "--role", "worker"],
        ["token", "new", "--name", "w", "--role", "admin"],
        ["token", "new", "--name", "w"],
    ],
)
def test_token_new_refuses_bad_names_and_roles(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusals
        code = int(exc.code or 0)
    assert code == 2
    assert capsys.readouterr().out == ""


DIGEST = "a" * 64


def principal(name: str, roles: str = '["worker"]', digest: str = DIGEST) -> str:
    return f'[[auth.principals]]\nname = "{name}"\nroles = {roles}\ntoken_sha256 = "{digest}"\n'


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (principal("w1", '["admin"]'), "auth.principals[0] ('w1').roles[0]"),
        (
            principal("w1", digest="ABC"),
            "auth.principals[0] ('w1').token_sha256: expected the token's SHA-256",
        ),
        (
            '[[auth.principals]]\nname = "w1"\nroles = ["worker"]\ntoken = "secret"',
            "auth.principals[0] ('w1').token: unknown key",
        ),
        (principal("w1", "[]"), "auth.principals[0] ('w1').roles"),
        (principal("w 1"), "auth.principals[0] ('w 1').name: 1 to 200"),
        ("[auth]\nprincipals = []", "auth: principals: at least one"),
        ('[auth]\nmode = "on"', "auth.mode: unknown key"),
        (
            principal("w1") + principal("w1", digest="b" * 64),
            "principals[1].name 'w1' is used twice",
        ),
        (principal("w1") + principal("w2"), "principals[1] ('w2').token_sha256 is another"),
    ],
)
def test_config_errors_name_the_key(tmp_path: Path, section: str, message: str) -> None:
    path = tmp_path / "fencegate.toml"
    path.write_text(section + "\n")
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    assert message in str(raised.value)


def test_a_good_auth_section_loads(tmp_path: Path) -> None:
    path = tmp_path / "fencegate.toml"
    path.write_text(
        '[[auth.principals]]\nname = "ops@example"\nroles = ["operator", "observer"]\n'
        f'token_sha256 = "{token_sha256("t")}"\n'
    )
    auth = load_config(path).auth
    assert auth is not None and auth.principals[0].roles == ("operator", "observer")
    assert load_config(None).auth is None


@pytest.fixture
async def url(tmp_path: Path) -> AsyncIterator[str]:
    config = make_config(
        f"sqlite:///{tmp_path / 'fencegate.db'}",
        reconciler={"enabled": False},
        auth={
            "principals": [
                {"name": "op", "roles": ["operator"], "token_sha256": token_sha256(OPERATOR_TOKEN)},
                {"name": "ob", "roles": ["observer"], "token_sha256": token_sha256(OBSERVER_TOKEN)},
            ]
        },
    )
    app = create_app(config, store=build_test_store(config))
    with structlog.testing.capture_logs():
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            yield str(client.make_url("")).rstrip("/")


async def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = await asyncio.to_thread(main, list(argv))
    out, err = capsys.readouterr()
    return code, out, err


async def test_the_operator_cli_reads_the_token(
    url: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("FENCEGATE_TOKEN", raising=False)
    code, _, err = await _cli(capsys, "epoch", "show", "--url", url)
    assert code == 1 and "UNAUTHENTICATED" in err and "--token-file" in err

    token_file = tmp_path / "token"
    token_file.write_text(OPERATOR_TOKEN + "\n")
    code, out, err = await _cli(
        capsys, "epoch", "bump", "--url", url, "--token-file", str(token_file)
    )
    assert code == 0, out + err

    monkeypatch.setenv("FENCEGATE_TOKEN", OBSERVER_TOKEN)
    code, _, err = await _cli(capsys, "epoch", "show", "--url", url, "--json")
    assert code == 0, err
    code, _, err = await _cli(capsys, "epoch", "bump", "--url", url)
    assert code == 1 and "FORBIDDEN" in err
    # --token-file wins over the environment.
    code, _, err = await _cli(capsys, "claims", "pause", "--url", url, "--token-file",
                              str(token_file))  # fmt: skip
    assert code == 0, err


async def test_a_token_file_that_cannot_be_used_is_bad_usage(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = await _cli(capsys, "epoch", "show", "--url", url, "--token-file",
                              str(tmp_path / "missing"))  # fmt: skip
    assert code == 2 and "--token-file" in err
    two = tmp_path / "two"
    two.write_text("one two\n")
    code, _, err = await _cli(capsys, "epoch", "show", "--url", url, "--token-file", str(two))
    assert code == 2 and "one token" in err
