"""What the gateways' audit logs say was answered that the store no longer holds: the
operator's list after a Redis failover (or restore) that lost acknowledged writes.

The new master cannot list the records it lost; the gateways' logs can. Every effect step,
claim and commit is logged as it is answered, with its effectId or task and generation
(docs/operations.md, "Audit log"), and a running gateway writes its log to disk as it goes,
so the log is each gateway's journal of recent forwards: it survives the gateway's own
kill -9 up to the last line written. A record the log shows answered and the store lacks, or
holds at an earlier step, is one the failover lost. ``fencegate failover lost`` reads the
files and the store (gateway/store_cli.py); what is here is pure.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "Finding",
    "Journal",
    "LoggedClaim",
    "LoggedCommit",
    "LoggedEffect",
    "claim_finding",
    "commit_finding",
    "effect_finding",
    "read_journal",
]

#: The effect events that move a record, and the state each leaves it in. An abort records
#: NOT_APPLIED for a forward that never started.
_EFFECT_STATE = {
    "effect.prepared": "PREPARED",
    "effect.committed": "COMMITTED",
    "effect.not_applied": "NOT_APPLIED",
    "effect.unknown": "UNKNOWN",
    "effect.aborted": "NOT_APPLIED",
}
#: A line longer than this is not one of ours (an event line is well under 4 kB).
_MAX_LINE = 65_536


@dataclass(frozen=True)
class LoggedEffect:
    effect_id: str
    task: str
    slot: str | None
    downstream: str | None
    #: The state the last logged step left the record in.
    state: str
    ts: str
    where: str


@dataclass(frozen=True)
class LoggedClaim:
    task: str
    attempt: str
    generation: int
    ts: str
    where: str


@dataclass(frozen=True)
class LoggedCommit:
    task: str
    attempt: str
    generation: int
    commit_id: str
    ts: str
    where: str


@dataclass
class Journal:
    """The last logged step of every effect, the highest logged claim of every task and the
    last logged commit of every task."""

    effects: dict[str, LoggedEffect]
    claims: dict[str, LoggedClaim]
    commits: dict[str, LoggedCommit]
    lines: int = 0
    #: Lines that are not JSON objects of ours (a truncated last line after kill -9, text a
    #: process printed before logging was set up): counted, not fatal.
    skipped: int = 0


def _events(
    name: str, lines: Iterable[str], counts: list[int]
) -> Iterator[tuple[str, str, dict[str, object]]]:
    for number, line in enumerate(lines, 1):
        counts[0] += 1
        if len(line) > _MAX_LINE:
            counts[1] += 1
            continue
        try:
            event = json.loads(line)
        except ValueError:
            counts[1] += 1
            continue
        if not isinstance(event, dict) or not isinstance(event.get("event"), str):
            counts[1] += 1
            continue
        yield str(event.get("ts", "")), f"{name}:{number}", event


def _text(event: dict[str, object], key: str) -> str | None:
    value = event.get(key)
    return value if isinstance(value, str) else None


def _int(event: dict[str, object], key: str) -> int | None:
    value = event.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read_journal(logs: Iterable[tuple[str, Iterable[str]]]) -> Journal:
    """``logs``: (name, lines) per gateway log. Steps are ordered by their ``ts`` (every
    gateway stamps UTC ISO 8601; within one timestamp, by file and line), so the last step
    of an effect forwarded by one gateway and settled by another is the later one."""
    counts = [0, 0]
    steps = sorted(
        (
            (ts, index, where, event)
            for index, (name, lines) in enumerate(logs)
            for ts, where, event in _events(name, lines, counts)
        ),
        key=lambda step: (step[0], step[1]),
    )
    journal = Journal(effects={}, claims={}, commits={})
    for ts, _, where, event in steps:
        name = event["event"]
        task = _text(event, "task")
        if task is None:
            continue
        if name in _EFFECT_STATE:
            effect_id = _text(event, "effect_id")
            if effect_id is not None:
                journal.effects[effect_id] = LoggedEffect(
                    effect_id,
                    task,
                    _text(event, "slot"),
                    _text(event, "downstream"),
                    _EFFECT_STATE[str(name)],
                    ts,
                    where,
                )
        elif name == "claim.granted":
            attempt, generation = _text(event, "attempt"), _int(event, "generation")
            known = journal.claims.get(task)
            newer = known is None or (generation or 0) >= known.generation
            if attempt is not None and generation is not None and newer:
                journal.claims[task] = LoggedClaim(task, attempt, generation, ts, where)
        elif name == "commit.committed":
            attempt, generation = _text(event, "attempt"), _int(event, "generation")
            commit_id = _text(event, "commit_id")
            if attempt is not None and generation is not None and commit_id is not None:
                journal.commits[task] = LoggedCommit(
                    task, attempt, generation, commit_id, ts, where
                )
    journal.lines, journal.skipped = counts
    return journal


@dataclass(frozen=True)
class Finding:
    """One record the logs show answered and the store lacks or holds behind."""

    kind: Literal["effect", "claim", "commit"]
    #: The effectId, or the task id.
    key: str
    task: str
    logged: str
    stored: str
    #: What the operator does about it.
    advice: str
    where: str

    def line(self) -> str:
        return (
            f"{self.kind} {self.key} (task {self.task}): logged {self.logged} ({self.where}); "
            f"store: {self.stored}. {self.advice}"
        )


#: What the store holds of a record: a state, None for no record, "EXPIRED" for a record the
#: retention sweep removed (it was settled: nothing was lost).
StoredEffect = str | None


def effect_finding(logged: LoggedEffect, stored: StoredEffect) -> Finding | None:
    """A lost effect record is the dangerous loss: a retry under a new claim finds no record
    and is forwarded again. A lost NOT_APPLIED record loses nothing (it may go again)."""
    if stored == "EXPIRED" or logged.state == "NOT_APPLIED":
        return None
    via = f" through {logged.downstream}" if logged.downstream else ""
    if stored is None:
        sent = "was sent" if logged.state == "COMMITTED" else "may have been sent"
        return Finding(
            "effect",
            logged.effect_id,
            logged.task,
            logged.state,
            "no record",
            f"It {sent}{via}; a retry of slot {logged.slot} under a new claim is forwarded "
            f"again unless the downstream deduplicates on Idempotency-Key {logged.effect_id}: "
            "check the downstream before the task runs again (hold it: cancel or revise it).",
            logged.where,
        )
    if stored == "PREPARED" and logged.state in ("COMMITTED", "UNKNOWN"):
        return Finding(
            "effect",
            logged.effect_id,
            logged.task,
            logged.state,
            "PREPARED",
            "Its outcome was lost: the record reads UNKNOWN once its deadline passes; settle it "
            f"with fencegate effects resolve {logged.effect_id} (the log says {logged.state}).",
            logged.where,
        )
    return None


def claim_finding(logged: LoggedClaim, stored_generation: int | None) -> Finding | None:
    """``stored_generation``: the task's claim generation in the store; None for no task
    (the task's creation was lost too), -1 for a task the retention sweep removed."""
    if stored_generation is not None and (
        stored_generation < 0 or stored_generation >= logged.generation
    ):
        return None
    return Finding(
        "claim",
        logged.task,
        logged.task,
        f"generation {logged.generation} (attempt {logged.attempt})",
        "no task" if stored_generation is None else f"generation {stored_generation}",
        "Its holder is fenced (the acknowledgement's epoch bump; the attempt is on no record): "
        "it claims again. Effects it sent are listed above if they were lost too."
        + (
            " The task itself was lost: its scheduler must PUT it again."
            if stored_generation is None
            else ""
        ),
        logged.where,
    )


def commit_finding(
    logged: LoggedCommit, stored_commit_id: str | None, gone: bool
) -> Finding | None:
    """A lost commit: the worker was told its result is the task's canonical one, and the
    task will be claimed and run again. ``gone``: the task is not in the store at all."""
    if stored_commit_id == logged.commit_id or stored_commit_id == "EXPIRED":
        return None
    return Finding(
        "commit",
        logged.task,
        logged.task,
        f"commit {logged.commit_id} (generation {logged.generation})",
        "no task"
        if gone
        else ("not committed" if stored_commit_id is None else f"commit {stored_commit_id}"),
        "The worker was told this result is the task's; the task will be claimed and run "
        "again: its effects replay from the ledger where their records survived.",
        logged.where,
    )
