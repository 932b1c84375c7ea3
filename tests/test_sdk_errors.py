"""The SDK's error table is its own copy of the server's, held to it here.

The SDK a worker installs loads none of the server (tests/test_layers.py), so its classes
cannot be built from ``fencegate.ledger.errors`` at import time; they are written out, and
every drift, either way, fails one of these: a code one side has and the other lacks, a
status that differs, a code that is "the claim is gone" (``ClaimRefused``) on one side only.
"""

from __future__ import annotations

import ast
from pathlib import Path

import fencegate
from fencegate import errors as sdk
from fencegate.gateway.problems import ROUTING_PROBLEMS
from fencegate.ledger import errors as server

GATEWAY = Path(__file__).resolve().parent.parent / "gateway"


def _wire_table() -> dict[str, int]:
    """Every code the gateway answers -> its status: its errors and its routing refusals."""
    table = {code: cls.status for code, cls in server.ERRORS_BY_CODE.items()}
    for status, (code, _) in ROUTING_PROBLEMS.items():
        assert code not in table, code
        table[code] = status
    return table


def test_the_sdk_has_a_class_for_every_code_the_gateway_answers_and_no_other() -> None:
    wire = _wire_table()
    sdk_codes = set(sdk.ERRORS_BY_CODE)
    assert sdk_codes - set(wire) == set(), "SDK classes for codes the gateway never answers"
    assert set(wire) - sdk_codes == set(), "gateway codes without an SDK class"


def test_each_code_has_the_same_status_in_the_sdk_and_the_gateway() -> None:
    wire = _wire_table()
    differ = {
        code: (cls.status, wire[code])
        for code, cls in sdk.ERRORS_BY_CODE.items()
        if cls.status != wire.get(code)
    }
    assert not differ, differ


def test_claim_refused_is_the_same_family_in_the_sdk_and_the_gateway() -> None:
    """One meaning of "the claim is gone": the SDK's ``ClaimRefused`` classes, the codes on
    which the SDK ends a lease and the server's ``CLAIM_REFUSED_CODES`` are one set."""
    sdk_family = {
        code for code, cls in sdk.ERRORS_BY_CODE.items() if issubclass(cls, sdk.ClaimRefused)
    }
    assert sdk_family == server.CLAIM_REFUSED_CODES
    assert sdk.LEASE_ENDING_CODES == server.CLAIM_REFUSED_CODES
    assert {"ALREADY_COMMITTED", "NO_SUCH_TASK", "TASK_EXPIRED"} <= sdk_family


def test_every_sdk_class_is_exported_and_the_class_of_its_status() -> None:
    """A family member stays the class of its status: ``except NotFound`` catches a
    ``NoSuchTask``, ``except Conflict`` a ``Fenced``, and an unknown code of that status
    gets the same base (``error_from_problem``)."""
    for code, cls in sdk.ERRORS_BY_CODE.items():
        assert cls.__name__ in fencegate.__all__, cls
        assert cls.code == code
        base = sdk._BY_STATUS.get(cls.status)  # none for 410: gone tasks, effects, events
        assert base is None or issubclass(cls, base), (cls, base)
        built = sdk.error_from_problem(cls.status, {"code": code, "detail": "d"})
        assert type(built) is cls


def test_every_code_the_gateway_writes_by_hand_is_in_the_table() -> None:
    """A handler that renders a problem itself (``problem_body(status, "CODE", ...)``) rather
    than raising an error names a code the table must have, or the SDK would not know it."""
    wire = _wire_table()
    written: dict[str, str] = {}
    for path in GATEWAY.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "problem_body"
                and len(node.args) >= 2
            ):
                for part in ast.walk(node.args[1]):
                    if isinstance(part, ast.Constant) and isinstance(part.value, str):
                        written[part.value] = f"{path.name}:{node.lineno}"
    assert written, "no problem_body call found: the scan is broken"
    unknown = {code: where for code, where in written.items() if code not in wire}
    assert not unknown, unknown
