"""Every fixed list of values the CLI takes (``choices=``) is its source's list, not a retyped one.

The test walks ``fencegate``'s whole parser, so an option given ``choices`` later is found
here too: it fails until the option is named in ``SOURCES`` with the list it must equal
(states, outcomes, roles). A retyped list once refused ``fencegate tasks list --state
WAITING``, which the API takes.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import get_args

import pytest

from fencegate.gateway.cli import build_parser
from fencegate.gateway.config import ROLES, Role
from fencegate.gateway.ledger_api import ResolveBody
from fencegate.ledger.effects import RESOLVE_OUTCOMES, EffectState
from fencegate.ledger.tasks import TaskState

#: (command path, option) -> the values it must take, read from their one source.
SOURCES: dict[tuple[str, str], frozenset[str]] = {
    ("fencegate effects list", "--state"): frozenset(EffectState),
    ("fencegate effects resolve", "--outcome"): frozenset(RESOLVE_OUTCOMES),
    ("fencegate tasks list", "--state"): frozenset(TaskState),
    ("fencegate token new", "--role"): frozenset(get_args(Role)),
}


def _options_with_choices(
    parser: argparse.ArgumentParser, path: str
) -> Iterator[tuple[tuple[str, str], list[str]]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _options_with_choices(child, f"{path} {name}")
        elif action.choices is not None:
            option = action.option_strings[-1] if action.option_strings else action.dest
            yield (path, option), [str(choice) for choice in action.choices]


def test_every_option_with_choices_is_held_to_its_source() -> None:
    found = dict(_options_with_choices(build_parser(), "fencegate"))
    assert set(found) == set(SOURCES), "name each option with choices in SOURCES"
    for where, choices in found.items():
        assert len(choices) == len(set(choices)), where
        assert set(choices) == SOURCES[where], where


def test_the_sources_agree_with_the_api() -> None:
    """The API's own lists are the same sources: the resolve body's outcomes, the roles."""
    assert set(get_args(ResolveBody.model_fields["outcome"].annotation)) == set(RESOLVE_OUTCOMES)
    assert set(ROLES) == set(get_args(Role))


@pytest.mark.parametrize("state", [state.value for state in TaskState])
def test_tasks_list_takes_every_task_state(state: str) -> None:
    """``tasks list --state WAITING`` (any case) parses, as the API takes it."""
    args = build_parser().parse_args(["tasks", "list", "--state", state.lower()])
    assert args.state == state
