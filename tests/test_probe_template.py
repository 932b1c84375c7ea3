"""Probe path templates (issue 11): RFC 6570 simple expansion, and a probe never leaves the
downstream's base path. Pure: no socket (the through-the-gateway story is in
tests/test_proxy_hardening.py).

Before issue 11 a slot of ``../../../../admin/wipe-all`` made the reconciler send ``GET
/admin/wipe-all`` with the downstream's credentials, and a 404 there read as "absent", which
let the effect go out a second time.
"""

from __future__ import annotations

from urllib.parse import quote, unquote

import hypothesis.strategies as st
import pytest
from hypothesis import given

from fencegate.adapters import ProbeAdapter, ProbeSpec
from fencegate.adapters.kinds import UnsafeProbePath, expand_probe_path
from fencegate.adapters.paths import escapes_base
from fencegate.ledger.effects import Effect, EffectState

HOSTILE = "../../../../admin/wipe-all"


def spec(path: str) -> ProbeSpec:
    return ProbeSpec(
        method="GET",
        path=path,
        found_statuses=frozenset({200}),
        absent_statuses=frozenset({404}),
        json_field=None,
        found_values=(),
        absent_values=(),
        timeout_ms=1_000,
        interval_ms=100,
        max_interval_ms=1_000,
    )


def effect(slot: str = "s1", node: str = "main", task_id: str = "t1") -> Effect:
    return Effect(
        effect_id="e" * 64,
        task_id=task_id,
        revision=3,
        node=node,
        slot=slot,
        downstream="orders",
        method="POST",
        path="/orders",
        payload_digest="d" * 64,
        state=EffectState.UNKNOWN,
        created_at=0,
        updated_at=0,
    )


def test_a_hostile_slot_is_not_probed_even_encoded() -> None:
    """``..%2F..%2Fadmin`` is one segment to the gateway, but a server that decodes ``%2F``
    before it normalises (nginx does) climbs out: ``adapters/paths.py`` refuses it (issue 25)."""
    adapter = ProbeAdapter(probe=spec("/orders/by-key/{slot}"))
    with pytest.raises(UnsafeProbePath):
        adapter.probe_path(effect(slot=HOSTILE))
    assert adapter.probe_path(effect(slot="a/b")) == "/orders/by-key/a%2Fb"  # a name, one piece


def test_every_placeholder_is_encoded() -> None:
    adapter = ProbeAdapter(probe=spec("/t/{taskId}/{node}/{slot}/{revision}/{effectId}?k={slot}"))
    path = adapter.probe_path(effect(slot="a/b:c@d", node="n?x#y", task_id="team/job-1"))
    assert path == f"/t/team%2Fjob-1/n%3Fx%23y/a%2Fb%3Ac%40d/3/{'e' * 64}?k=a%2Fb%3Ac%40d"


@pytest.mark.parametrize("value", [".", ".."])
def test_a_dot_segment_is_never_sent(value: str) -> None:
    """``.`` is unreserved, so RFC 6570 leaves ``..`` as it is: refused, not sent."""
    adapter = ProbeAdapter(probe=spec("/orders/by-key/{slot}"))
    with pytest.raises(UnsafeProbePath):
        adapter.probe_path(effect(slot=value))


def test_encoded_dots_in_a_value_are_encoded_again() -> None:
    assert expand_probe_path("/k/{slot}", {"slot": "%41"}) == "/k/%2541"
    # ... and a value that decodes to a dot segment (a server may decode twice) is refused.
    for value in ("%2E%2E", "..;x", "%u002e", "\uff0e\uff0e"):
        with pytest.raises(UnsafeProbePath):
            expand_probe_path("/k/{slot}", {"slot": value})


@pytest.mark.parametrize("template", ["/a/../{slot}", "/a/%2e%2E/{slot}", "/a/./{slot}"])
def test_a_template_with_a_dot_segment_is_refused(template: str) -> None:
    with pytest.raises(UnsafeProbePath):
        expand_probe_path(template, {"slot": "s1"})


def test_dots_inside_a_segment_or_in_the_query_are_fine() -> None:
    assert expand_probe_path("/by-key/{slot}", {"slot": "a..b"}) == "/by-key/a..b"
    assert expand_probe_path("/by-key/x{slot}", {"slot": ".."}) == "/by-key/x.."
    assert expand_probe_path("/by-key?slot={slot}", {"slot": ".."}) == "/by-key?slot=.."


VALUES = st.text(min_size=1, max_size=30)


@given(VALUES, VALUES)
def test_expansion_never_adds_structure(slot: str, node: str) -> None:
    """Whatever the values, the path has the template's segments, each value reads back as
    itself, and no segment climbs out."""
    try:
        path = expand_probe_path("/base/{node}/by-key/{slot}", {"slot": slot, "node": node})
    except UnsafeProbePath:
        # some server could read a value as (or as holding) a dot segment: adapters/paths.py
        assert escapes_base(quote(slot, safe="")) or escapes_base(quote(node, safe=""))
        return
    segments = path.split("/")
    assert len(segments) == 5 and "?" not in path and "#" not in path
    assert unquote(segments[2]) == node and unquote(segments[4]) == slot
    assert all(unquote(s) not in (".", "..") for s in segments)
