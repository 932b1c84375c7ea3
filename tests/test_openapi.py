"""docs/openapi.json: what ``GET /openapi.json`` serves, valid OpenAPI 3.1, the app's routes
exactly, real answers (granted and refused) validate against it, and its state enums are the
ledger's."""

from __future__ import annotations

import enum
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from jsonschema import Draft202012Validator
from openapi_spec_validator import validate as validate_spec
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from fencegate.gateway.app import create_app
from fencegate.gateway.auth import route_key
from fencegate.gateway.openapi import document_bytes
from fencegate.ledger.effects import EffectState, ProbeVerdict
from fencegate.ledger.tasks import TaskState
from tests.api import Api
from tests.conftest import build_test_store, make_config
from tests.downstream import Downstream

ROOT = Path(__file__).resolve().parent.parent
DOC_PATH = ROOT / "docs" / "openapi.json"
DOC: dict[str, Any] = json.loads(DOC_PATH.read_text())
DOC_URI = "urn:fencegate:openapi"
REGISTRY: Registry[Any] = Registry().with_resource(
    DOC_URI, Resource.from_contents(DOC, default_specification=DRAFT202012)
)
METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")
#: ``*`` (the proxy) is documented as each of these.
ANY_METHOD = {"GET", "HEAD", "OPTIONS", "POST", "PUT", "PATCH", "DELETE"}


def _pointer(*parts: str) -> str:
    return "/".join(p.replace("~", "~0").replace("/", "~1") for p in parts)


def check_answer(method: str, path: str, status: int, content_type: str, body: Any) -> None:
    """``body`` is a valid answer of ``method path`` with ``status`` per the document."""
    operation = DOC["paths"][path][method.lower()]
    answer = operation["responses"].get(str(status))
    assert answer is not None, f"{method} {path}: {status} is not documented"
    location = ["paths", path, method.lower(), "responses", str(status)]
    if "$ref" in answer:
        name = answer["$ref"].rsplit("/", 1)[1]
        answer = DOC["components"]["responses"][name]
        location = ["components", "responses", name]
    assert content_type in answer["content"], (content_type, list(answer["content"]))
    pointer = _pointer(*location, "content", content_type, "schema")
    validator = Draft202012Validator({"$ref": f"{DOC_URI}#/{pointer}"}, registry=REGISTRY)
    errors = sorted(validator.iter_errors(body), key=lambda e: list(e.path))
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors]


def test_docs_openapi_json_is_what_the_module_renders() -> None:
    assert DOC_PATH.read_bytes() == document_bytes(), (
        "docs/openapi.json is stale: python -m fencegate.gateway.openapi > docs/openapi.json"
    )


def test_the_document_is_valid_openapi_3_1() -> None:
    assert DOC["openapi"].startswith("3.1.")
    validate_spec(DOC)


def test_every_route_is_documented_with_its_methods_and_nothing_else(tmp_path: Path) -> None:
    config = make_config(f"sqlite:///{tmp_path / 'fg.db'}")
    app = create_app(config, store=build_test_store(config))
    registered: dict[str, set[str]] = {}
    for route in app.router.routes():
        key = route_key(route)
        assert key is not None
        method, path = key
        registered.setdefault(path, set()).update(ANY_METHOD if method == "*" else {method})
        if method == "GET":
            registered[path].add("HEAD")  # aiohttp answers HEAD on every GET route
    documented: dict[str, set[str]] = {
        path: {m.upper() for m in item if m in METHODS} for path, item in DOC["paths"].items()
    }
    for methods in documented.values():
        if "GET" in methods:
            methods.add("HEAD")
    assert documented == registered


def test_problem_answers_name_the_contract_codes() -> None:
    for name, answer in DOC["components"]["responses"].items():
        schema = answer["content"]["application/problem+json"]["schema"]
        codes = schema["allOf"][1]["properties"]["code"]["enum"]
        assert codes, name
    assert DOC["components"]["securitySchemes"]["fenceBearer"]["name"] == "Fence-Authorization"


#: The ledger's enums the document lists, each once, as a component of that name.
LEDGER_ENUMS: dict[str, type[enum.StrEnum]] = {
    "TaskState": TaskState,
    "EffectState": EffectState,
    "ProbeVerdict": ProbeVerdict,
}


def _enums(node: Any, where: str = "") -> Iterator[tuple[str, list[Any]]]:
    """Every ``enum`` list in ``node``, with its JSON pointer."""
    if isinstance(node, dict):
        if isinstance(node.get("enum"), list):
            yield where, node["enum"]
        for key, value in node.items():
            yield from _enums(value, f"{where}/{_pointer(key)}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _enums(value, f"{where}/{index}")


def test_state_enums_are_the_ledgers_and_every_use_refers_to_them() -> None:
    schemas = DOC["components"]["schemas"]
    for name, states in LEDGER_ENUMS.items():
        assert schemas[name]["enum"] == [state.value for state in states], name
    whole = {frozenset(state.value for state in states) for states in LEDGER_ENUMS.values()}
    homes = {f"/components/schemas/{name}" for name in LEDGER_ENUMS}
    copies = [where for where, values in _enums(DOC) if frozenset(values) in whole]
    assert set(copies) == homes, "a state list written out instead of referring to its enum"
    params = {
        (path, p["name"]): p["schema"]
        for path in ("/v1/tasks", "/v1/tasks/{task_id}", "/v1/effects")
        for p in DOC["paths"][path]["get"].get("parameters", [])
    }
    assert params[("/v1/tasks", "state")] == {"$ref": "#/components/schemas/TaskState"}
    assert params[("/v1/tasks/{task_id}", "waitFor")] == {"$ref": "#/components/schemas/TaskState"}
    assert params[("/v1/effects", "state")] == {"$ref": "#/components/schemas/EffectState"}
    header = DOC["paths"]["/proxy/{tail}"]["post"]["responses"]["default"]["headers"]
    assert header["Fence-Effect-State"]["schema"]["enum"] == ["NONE", *EffectState]


#: Grows each ledger enum by one member, then renders the document (in a fresh interpreter:
#: the patch must come before the gateway's modules read the enums).
_GROWN = """
import enum, json, sys
from fencegate.ledger import effects, tasks

def grown(states, name, value):
    return enum.StrEnum(states.__name__, [*((s.name, s.value) for s in states), (name, value)])

tasks.TaskState = grown(tasks.TaskState, "PARKED", "PARKED")
effects.EffectState = grown(effects.EffectState, "DISPUTED", "DISPUTED")
effects.ProbeVerdict = grown(effects.ProbeVerdict, "REFUSED", "refused")
from fencegate.gateway.openapi import document
json.dump(document(), sys.stdout)
"""


def test_a_member_the_ledger_adds_to_an_enum_reaches_the_document() -> None:
    """The schema enums are derived, not retyped: a state the ledger gains is in the
    document without anyone writing it there (and docs/openapi.json is then stale)."""
    rendered = subprocess.run(
        [sys.executable, "-c", _GROWN], capture_output=True, check=True, timeout=120
    )
    grown = json.loads(rendered.stdout)
    schemas = grown["components"]["schemas"]
    assert schemas["TaskState"]["enum"] == [*(s.value for s in TaskState), "PARKED"]
    assert schemas["EffectState"]["enum"] == [*(s.value for s in EffectState), "DISPUTED"]
    assert schemas["ProbeVerdict"]["enum"] == [*(s.value for s in ProbeVerdict), "refused"]
    header = grown["paths"]["/proxy/{tail}"]["post"]["responses"]["default"]["headers"]
    assert "DISPUTED" in header["Fence-Effect-State"]["schema"]["enum"]
    whole = {frozenset(schemas[name]["enum"]) for name in LEDGER_ENUMS}
    homes = {f"/components/schemas/{name}" for name in LEDGER_ENUMS}
    assert {where for where, values in _enums(grown) if frozenset(values) in whole} == homes


@pytest.fixture
async def api(tmp_path: Path, downstream: Downstream) -> AsyncIterator[Api]:
    config = make_config(
        f"sqlite:///{tmp_path / 'fg.db'}",
        reconciler={"enabled": False},
        downstreams=[{"name": "api", "url": downstream.url, "timeout_ms": 2000}],
    )
    app = create_app(config, store=build_test_store(config))
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield Api(client)


async def test_served_document_is_the_file(api: Api) -> None:
    async with api.client.get("/openapi.json") as resp:
        assert resp.status == 200
        assert resp.content_type == "application/json"
        assert await resp.read() == DOC_PATH.read_bytes()


async def test_real_answers_match_their_schemas(api: Api) -> None:
    async def call(method: str, path: str, doc_path: str, body: Any = None) -> Any:
        answer = await api.call(method, path, body)
        check_answer(method, doc_path, answer.status, answer.content_type, answer.body)
        return answer

    task = "/v1/tasks/{task_id}"
    assert (await call("PUT", "/v1/tasks/t1", task, {"inputDigest": "in-1"})).status == 201
    assert (await call("PUT", "/v1/tasks/t1", task, {"inputDigest": "in-1"})).status == 200
    assert (await call("GET", "/v1/tasks/nope", task)).code == "NO_SUCH_TASK"
    bad = await call("PUT", "/v1/tasks/t2", task, {"inputDigest": 5, "extra": 1})
    assert bad.code == "BAD_REQUEST"
    lease = await api.claim("t1")
    claimed = await call(
        "POST", "/v1/tasks/t1/claim", task + "/claim", {"owner": "w2", "ttlMs": 1000,
                                                        "schedulerEpoch": lease.scheduler_epoch},
    )  # fmt: skip
    assert claimed.code == "CLAIMED" and claimed.body["leaseExpiresAt"] == lease.lease_expires_at
    renew = {**lease.identity(), "ttlMs": 5000}
    assert (await call("POST", "/v1/tasks/t1/renew", task + "/renew", renew)).status == 200

    fence = {
        "Fence-Task": "t1",
        "Fence-Attempt": lease.attempt_id,
        "Fence-Generation": str(lease.claim_generation),
        "Fence-Epoch": str(lease.scheduler_epoch),
        "Fence-Cancel": str(lease.cancel_generation),
        "Fence-Slot": "pay",
    }
    async with api.client.post("/proxy/api/ok/pay", json={"amount": 1}, headers=fence) as resp:
        assert resp.status == 200
        effect_id = resp.headers["Fence-Effect-Id"]
        assert resp.headers["Fence-Effect-State"] == "COMMITTED"

    commit = {**lease.identity(), "inputDigest": "in-1", "resultDigest": "out-1", "result": [1]}
    commit.pop("owner")
    assert (await call("POST", "/v1/tasks/t1/commit", task + "/commit", commit)).status == 200
    assert (await call("GET", "/v1/tasks/t1", task)).body["commit"]["result"] == [1]
    assert (await call("POST", "/v1/tasks/t1/release", task + "/release", lease.identity())).code

    await call("GET", "/v1/epoch", "/v1/epoch")
    await call("GET", "/v1/rollout", "/v1/rollout")
    await call("POST", "/v1/claims/pause", "/v1/claims/pause")
    paused = await call(
        "POST", "/v1/tasks/t1/claim", task + "/claim", {"owner": "w", "ttlMs": 9,
                                                        "schedulerEpoch": 1},
    )  # fmt: skip
    assert paused.status in (409, 503)
    await call("POST", "/v1/claims/resume", "/v1/claims/resume")
    await call("POST", "/v1/epoch/bump", "/v1/epoch/bump")
    assert (await call("POST", "/v1/tasks/t1/cancel", task + "/cancel")).code == "ALREADY_COMMITTED"
    await call("PUT", "/v1/tasks/t3", task, {"inputDigest": "in-1"})
    assert (await call("POST", "/v1/tasks/t3/cancel", task + "/cancel")).status == 200

    page = await call("GET", "/v1/effects?limit=5", "/v1/effects")
    assert [e["effectId"] for e in page.body["effects"]] == [effect_id]
    assert (await call("GET", "/v1/effects?limit=%C2%B2", "/v1/effects")).status == 400
    one = "/v1/effects/{effect_id}"
    assert (await call("GET", f"/v1/effects/{effect_id}", one)).body["state"] == "COMMITTED"
    assert (await call("GET", f"/v1/effects/{'0' * 64}", one)).code == "NO_SUCH_EFFECT"
    settled = await call(
        "POST", f"/v1/effects/{effect_id}/resolve", one + "/resolve",
        {"outcome": "NOT_APPLIED", "note": "x"},
    )  # fmt: skip
    assert settled.code == "EFFECT_SETTLED"
    reconciled = await call("POST", f"/v1/effects/{effect_id}/reconcile", one + "/reconcile")
    assert reconciled.status == 200

    tasks = await call("GET", "/v1/tasks?limit=2", "/v1/tasks")
    assert [t["taskId"] for t in tasks.body["tasks"]] == ["t1", "t3"]
    assert (await call("GET", "/v1/tasks?state=DONE", "/v1/tasks")).status == 400

    for path in ("/healthz", "/readyz"):
        await call("GET", path, path)
    assert (await call("GET", "/healthz", "/healthz")).body["version"]
