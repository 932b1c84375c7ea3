"""What the operator commands print: tables and readable records, from the gateway's JSON.

Pure functions from the records the ledger and coordination APIs answer (plain dicts, as
``docs/PROTOCOL.md`` shapes them) to text: no I/O, no client. ``fencegate.gateway.ops_commands``
calls them and prints what they return. Times are UTC.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

__all__ = [
    "approved",
    "cell",
    "claimed",
    "claimed_line",
    "claims_paused",
    "claims_resumed",
    "effect",
    "effects_table",
    "epoch_bumped",
    "fields",
    "gateway_line",
    "header_lines",
    "json_text",
    "printable",
    "reconciled",
    "resolved",
    "rollout",
    "scheduler_line",
    "store_stats",
    "table",
    "task",
    "tasks_table",
    "time_text",
    "whose",
    "with_gateway",
]

#: A stored response body up to this size is shown as text (if it is printable UTF-8).
SHOW_BODY_BYTES = 400
EFFECTS_HEADERS = ("EFFECT", "STATE", "TASK/KEY", "DOWNSTREAM", "REQUEST", "ATTEMPTS", "UPDATED")
TASKS_HEADERS = ("TASK", "STATE", "OWNER", "GEN", "REVISION", "LEASE EXPIRES")


# --- building blocks ----------------------------------------------------------------------------


def time_text(ms: object, *, precise: bool = False) -> str:
    """A store time (ms since the epoch) as UTC, to the second or (``precise``) the ms."""
    if not isinstance(ms, int):
        return "-"
    moment = datetime.fromtimestamp(ms / 1000, UTC)
    if precise:
        return moment.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"
    return moment.strftime("%Y-%m-%d %H:%M:%SZ")


def printable(value: object) -> str:
    """``value`` as text a terminal shows as it is: every character that is not printable
    (control characters such as ESC, newlines, bidi overrides, zero-width ones) is written as
    its Python escape (``\\x1b``, ``\\n``, ``\\u202e``). Owners, notes, reasons and paths come
    from clients; a raw escape sequence must not rewrite the operator's screen."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def cell(value: object, width: int = 0) -> str:
    """``value`` as a table cell: ``-`` when missing, escaped (``printable``), cut with
    ``...`` past ``width``."""
    text = "-" if value is None or value == "" else printable(value)
    if width and len(text) > width:
        text = text[: width - 3] + "..."
    return text


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns, two spaces apart."""
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    lines = [
        "  ".join(text.ljust(width) for text, width in zip(row, widths, strict=True)).rstrip()
        for row in [headers, *rows]
    ]
    return "\n".join(lines)


def fields(pairs: Sequence[tuple[str, object]]) -> str:
    """One ``name  value`` line per pair, the values aligned."""
    width = max(len(name) for name, _ in pairs)
    return "\n".join(f"{name.ljust(width)}  {cell(value)}" for name, value in pairs)


def json_text(data: Any) -> str:
    """What ``--json`` prints: the gateway's JSON, indented."""
    return json.dumps(data, indent=2)


def _indent(text: str) -> str:
    return "\n".join(f"  {line}" for line in text.splitlines())


def gateway_line(url: str, origin: str) -> str:
    """The first line of every answer: which gateway answered, and why that one."""
    return f"gateway {printable(url)} ({printable(origin)})"


def with_gateway(data: Any, url: str, key: str = "") -> dict[str, Any]:
    """``--json``'s answer: ``data`` with a top-level ``"gateway"`` first; data that is not an
    object (a list) goes under ``key``."""
    if isinstance(data, Mapping):
        return {"gateway": url, **data}
    return {"gateway": url, key or "answer": data}


def header_lines(headers: Mapping[str, str]) -> str:
    """``Name: value`` lines, as ``curl -H @FILE`` reads them (values escaped: a claim's
    task id must not start a header of its own)."""
    return "\n".join(f"{printable(name)}: {printable(value)}" for name, value in headers.items())


# --- effects ------------------------------------------------------------------------------------


def _is_keyed(r: Mapping[str, Any]) -> bool:
    """A lease-less client's effect (identified by its Idempotency-Key, no task fields); a
    record of an older gateway has no ``kind`` and is a leased one."""
    return r.get("kind") == "keyed"


def whose(r: Mapping[str, Any]) -> str:
    """Who an effect belongs to, in one cell: a leased effect's task, or ``key:`` and a keyed
    effect's principal and client key (its task fields are null)."""
    if _is_keyed(r):
        return f"key:{r.get('principal')}/{r.get('idempotencyKey')}"
    return str(r.get("taskId"))


def effects_table(records: Sequence[Mapping[str, Any]]) -> str:
    """``effects list``: one row per ledger record."""
    if not records:
        return "no effects"
    rows = [
        [
            cell(r.get("effectId"))[:12],
            cell(r.get("state")),
            cell(whose(r), 32),
            cell(r.get("downstream")),
            cell(f"{r.get('method')} {r.get('path')}", 48),
            str(len(r.get("attempts") or [])),
            time_text(r.get("updatedAt")),
        ]
        for r in records
    ]
    return table(EFFECTS_HEADERS, rows)


def _response_lines(response: Mapping[str, Any]) -> list[str]:
    lines = [f"  status   {cell(response.get('status'))}"]
    if response.get("source"):
        lines.append(f"  source   {cell(response['source'])}")
    headers = response.get("headers") or []
    if headers:
        lines.append(f"  headers  {len(headers)} stored")
    if response.get("bodyOmitted"):
        why = response.get("bodyOmittedReason") or "larger than the downstream's replay_max_bytes"
        lines.append(f"  body     not stored ({printable(why)})")
        return lines
    size, digest = response.get("bodySize"), response.get("bodyDigest")
    try:
        raw = base64.b64decode(str(response.get("bodyBase64", "")), validate=True)
        text = raw.decode("utf-8") if len(raw) <= SHOW_BODY_BYTES else None
    except (binascii.Error, UnicodeDecodeError):
        text = None
    if text and text.isprintable():
        lines.append(f"  body     {text}")
    else:
        lines.append(f"  body     {cell(size)} bytes, sha256 {cell(digest)}")
    return lines


def _request_lines(kept: Mapping[str, Any]) -> list[str]:
    """A kept request (``keep_request_bodies``): every header, then the body as kept."""
    headers = kept.get("headers") or []
    lines = [f"  header   {printable(name)}: {printable(value)}" for name, value in headers]
    size = cell(kept.get("bodySize"))
    cut = f" (cut to keep_request_max_bytes of {size} bytes)" if kept.get("truncated") else ""
    if kept.get("bodyWithheld"):
        lines.append(f"  body     withheld: kept requests are for operators ({size} bytes)")
    elif kept.get("bodyOmittedReason"):
        lines.append(f"  body     not kept ({printable(kept['bodyOmittedReason'])})")
    elif "body" in kept:
        lines.append(f"  body{cut}")
        lines.extend(f"    {printable(line)}" for line in str(kept["body"]).splitlines())
    elif "bodyBase64" in kept:
        lines.append(f"  body     {size} bytes, not UTF-8{cut}; base64:")
        lines.append(f"    {cell(kept['bodyBase64'])}")
    return lines


def effect(r: Mapping[str, Any]) -> str:
    """``effects show``: the record, its attempts, operator actions and stored response."""
    pairs: list[tuple[str, object]] = [
        ("effect", r.get("effectId")),
        ("state", r.get("state")),
        ("kind", "keyed" if _is_keyed(r) else "leased"),
    ]
    if _is_keyed(r):
        # A lease-less client's: no task, revision, node or slot; its key is its identity.
        pairs += [("principal", r.get("principal")), ("idempotencyKey", r.get("idempotencyKey"))]
    else:
        pairs.append(
            (
                "task",
                f"{r.get('taskId')} (revision {r.get('revision')}, node {r.get('node')}, "
                f"slot {r.get('slot')})",
            )
        )
    pairs += [
        ("downstream", r.get("downstream")),
        ("request", f"{r.get('method')} {r.get('path')}"),
        ("payloadDigest", r.get("payloadDigest")),
        # The payload and its effect-changing headers: what an approval names (an older
        # gateway's record has none).
        ("approvalDigest", r.get("approvalDigest", r.get("payloadDigest"))),
        ("created", time_text(r.get("createdAt"), precise=True)),
        ("updated", time_text(r.get("updatedAt"), precise=True)),
    ]
    if r.get("state") == "PREPARED":
        pairs.append(("deadline", time_text(r.get("deadlineAt"), precise=True)))
    if r.get("lookUp"):
        pairs.append(("look up", r["lookUp"]))
    approval = r.get("approval")
    if isinstance(approval, dict):
        pairs.append(
            (
                "approval",
                f"approvalDigest {approval.get('approvalDigest', approval.get('payloadDigest'))}"
                f" (payloadDigest {approval.get('payloadDigest')}) by {approval.get('by')}, "
                f"usable until {time_text(approval.get('expiresAt'))}",
            )
        )
    probes = r.get("probes")
    if isinstance(probes, dict) and probes.get("count"):
        nxt = probes.get("nextAt")
        pairs.append(
            ("probes", f"{probes['count']}" + (f", next at {time_text(nxt)}" if nxt else ""))
        )
    out = [fields(pairs)]
    attempts = r.get("attempts") or []
    out.append(f"\nattempts ({len(attempts)}):")
    if attempts:
        rows = [
            [
                str(i),
                cell(a.get("attemptId")),
                cell(a.get("claimGeneration")),
                time_text(a.get("startedAt"), precise=True),
                time_text(a.get("endedAt"), precise=True),
                cell(a.get("outcome")),
                cell(a.get("reason"))
                + (f" (approved by {printable(a['approvedBy'])})" if a.get("approvedBy") else ""),
            ]
            for i, a in enumerate(attempts, 1)
        ]
        headers = ["#", "ATTEMPT", "GEN", "STARTED", "ENDED", "OUTCOME", "REASON"]
        out.append(_indent(table(headers, rows)))
    actions = r.get("actions") or []
    if actions:
        out.append(f"\nactions ({len(actions)}):")
        rows = [
            [
                time_text(a.get("at"), precise=True),
                cell(f"{a.get('action')} (forced)" if a.get("force") is True else a.get("action")),
                cell(a.get("by")),
                cell(a.get("outcome") or a.get("verdict")),
                cell(a.get("note"), 60),
            ]
            for a in actions
        ]
        out.append(_indent(table(["AT", "ACTION", "BY", "RESULT", "NOTE"], rows)))
    kept = r.get("request")
    if isinstance(kept, dict):
        out.append("\nrequest (as forwarded):")
        out.extend(_request_lines(kept))
    response = r.get("response")
    out.append("\nresponse:" if isinstance(response, dict) else "\nresponse: none stored")
    if isinstance(response, dict):
        out.extend(_response_lines(response))
    return "\n".join(out)


def resolved(effect_id: str, r: Mapping[str, Any]) -> str:
    """``effects resolve``: the outcome, and what it means for the next call. An identical
    repeat (``unchanged``, a retry after a lost answer) says that nothing changed rather than
    claim to have resolved it again."""
    if r.get("unchanged") is True:
        return (
            f"effect {printable(effect_id)} already resolved as {cell(r.get('state'))}; "
            "nothing changed"
        )
    text = f"effect {printable(effect_id)} resolved as {cell(r.get('state'))}"
    actions = r.get("actions") or []
    last = actions[-1] if actions and isinstance(actions[-1], dict) else {}
    if last.get("force") is True:
        text += (
            f" (forced: an earlier forward could still land until "
            f"{time_text(last.get('landingUntil'))})"
        )
    if r.get("state") == "NOT_APPLIED":
        text += "\nthe same payload may now be sent again under the same key"
    return text


def approved(effect_id: str, r: Mapping[str, Any]) -> str:
    """``effects approve``: which payload may go where, until when."""
    approval = r.get("approval") or {}
    return (
        f"effect {printable(effect_id)} approved: the next forward of approvalDigest "
        f"{cell(approval.get('approvalDigest', approval.get('payloadDigest')))} (payloadDigest "
        f"{cell(approval.get('payloadDigest'))}) goes to {cell(r.get('downstream'))} once, "
        f"until {time_text(approval.get('expiresAt'))}"
    )


def reconciled(effect_id: str, r: Mapping[str, Any]) -> str:
    """``effects reconcile``: the state afterwards, and the probe's verdict."""
    line = f"effect {printable(effect_id)} is {cell(r.get('state'))}"
    actions = r.get("actions") or []
    last = actions[-1] if actions else {}
    if last.get("action") == "reconcile":
        line += f" (last probe: {cell(last.get('verdict'))}, {time_text(last.get('at'))})"
    return line


# --- tasks, epoch, claims, rollout --------------------------------------------------------------


def task(t: Mapping[str, Any]) -> str:
    """``tasks show``: the task record, its current claim and its commit."""
    pairs: list[tuple[str, object]] = [
        ("task", t.get("taskId")),
        ("state", t.get("state")),
        ("revision", t.get("revision")),
        ("inputDigest", t.get("inputDigest")),
        ("claimGeneration", t.get("claimGeneration")),
        ("attempt", t.get("attemptId")),
        ("owner", t.get("owner")),
        ("attemptStarted", time_text(t.get("attemptStartedAt"), precise=True)),
        ("leaseExpires", time_text(t.get("leaseExpiresAt"), precise=True)),
        ("maxRuntimeMs", t.get("maxRuntimeMs")),
        ("cancelGeneration", t.get("cancelGeneration")),
        ("schedulerEpoch", t.get("schedulerEpoch")),
        ("created", time_text(t.get("createdAt"), precise=True)),
        ("updated", time_text(t.get("updatedAt"), precise=True)),
    ]
    commit = t.get("commit")
    if isinstance(commit, dict):
        pairs += [
            ("commit", commit.get("commitId")),
            ("  by attempt", f"{commit.get('attemptId')} (gen {commit.get('claimGeneration')})"),
            ("  resultDigest", commit.get("resultDigest")),
            ("  committed", time_text(commit.get("committedAt"), precise=True)),
        ]
        if "result" in commit:
            pairs.append(("  result", cell(json.dumps(commit["result"]), 200)))
    else:
        pairs.append(("commit", "none"))
    return fields(pairs)


def tasks_table(tasks: Sequence[Mapping[str, Any]]) -> str:
    """``tasks list``: one row per task."""
    if not tasks:
        return "no tasks"
    rows = [
        [
            cell(t.get("taskId"), 40),
            cell(t.get("state")),
            cell(t.get("owner"), 24),
            cell(t.get("claimGeneration")),
            cell(t.get("revision")),
            time_text(t.get("leaseExpiresAt")) if t.get("state") == "CLAIMED" else "-",
        ]
        for t in tasks
    ]
    return table(TASKS_HEADERS, rows)


def claimed_line(claim: Mapping[str, Any]) -> str:
    """One line: which claim, and until when nothing else may claim the task."""
    return (
        f"claimed {cell(claim.get('taskId'))} for {cell(claim.get('owner'))} "
        f"(claimGeneration {cell(claim.get('claimGeneration'))}, lease until "
        f"{time_text(claim.get('leaseExpiresAt'), precise=True)})"
    )


def claimed(claim: Mapping[str, Any]) -> str:
    """``tasks claim``: the claim's fencing token, and that nothing renews it."""
    pairs: list[tuple[str, object]] = [
        ("task", claim.get("taskId")),
        ("owner", claim.get("owner")),
        ("attempt", claim.get("attemptId")),
        ("claimGeneration", claim.get("claimGeneration")),
        ("schedulerEpoch", claim.get("schedulerEpoch")),
        ("cancelGeneration", claim.get("cancelGeneration")),
        ("revision", claim.get("revision")),
        ("inputDigest", claim.get("inputDigest")),
        ("leaseExpires", time_text(claim.get("leaseExpiresAt"), precise=True)),
        ("grantedTtlMs", claim.get("grantedTtlMs")),
    ]
    return (
        fields(pairs) + "\nnothing renews this lease: renew it before it expires, or another "
        "worker may claim the task (--headers prints its Fence-* headers for curl)"
    )


def scheduler_line(scheduler: Mapping[str, Any]) -> str:
    """``epoch show``: the epoch and whether claims are paused."""
    paused = "paused" if scheduler.get("claimsPaused") else "open"
    return f"scheduler epoch {cell(scheduler.get('schedulerEpoch'))}, claims {paused}"


def epoch_bumped(scheduler: Mapping[str, Any]) -> str:
    epoch = cell(scheduler.get("schedulerEpoch"))
    return (
        f"bumped the scheduler epoch to {epoch}: every claim granted under an earlier epoch "
        f"is fenced; schedulers must claim with schedulerEpoch {epoch}"
    )


def claims_paused(scheduler: Mapping[str, Any]) -> str:
    return (
        f"claims paused ({scheduler_line(scheduler)}): new claims answer "
        "503 CLAIMS_PAUSED until `fencegate claims resume`"
    )


def claims_resumed(scheduler: Mapping[str, Any]) -> str:
    return f"claims resumed ({scheduler_line(scheduler)})"


def rollout(status: Mapping[str, Any]) -> str:
    """``rollout status``: the rollback checklist and its verdict."""
    checklist = fields(
        [
            ("scheduler epoch", status.get("schedulerEpoch")),
            ("claims paused", status.get("claimsPaused")),
            ("active leases", status.get("activeLeases")),
            ("PREPARED effects", status.get("preparedEffects")),
            ("UNKNOWN effects", status.get("unknownEffects")),
            ("awaiting approval", status.get("awaitingApproval")),
        ]
    )
    if status.get("safeToSwitchPools"):
        return checklist + "\nsafe to switch pools"
    # The gateway's own words for each condition that fails (none from an older gateway).
    blockers = status.get("blockers")
    reasons = [
        cell(b.get("reason"), 80)
        for b in (blockers if isinstance(blockers, list) else [])
        if isinstance(b, dict)
    ]
    why = f": {', '.join(reasons)};" if reasons else ":"
    return (
        checklist + f"\nNOT safe to switch pools{why} wait for leases to expire and settle "
        "the effects"
    )


def _duration(ms: int) -> str:
    """``604800000`` as ``7d``: the largest unit that divides it, else milliseconds."""
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("min", 60_000), ("s", 1000)):
        if ms and ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


def _size(n: Any) -> str:
    if not isinstance(n, int) or isinstance(n, bool):
        return "unknown"
    if n < 1024:
        return f"{n} bytes"
    value, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.1f} {unit} ({n} bytes)"


def store_stats(stats: Mapping[str, Any]) -> str:
    """``store stats``: what the store holds, what expires next, and how big it is."""
    tasks, effects = stats.get("tasks") or {}, stats.get("effects") or {}
    stones, retention = stats.get("tombstones") or {}, stats.get("retention") or {}
    settled_ms = retention.get("settledMs")
    due = (
        f"due (settled {_duration(settled_ms)} ago or more)"
        if isinstance(settled_ms, int)
        else "due"
    )
    lines = fields(
        [
            ("tasks", tasks.get("total")),
            ("  claimed", tasks.get("claimed")),
            ("  settled", tasks.get("settled")),
            (f"  {due}", tasks.get("dueToExpire")),
            ("effects", effects.get("total")),
            ("  PREPARED", effects.get("prepared")),
            ("  UNKNOWN", effects.get("unknown")),
            ("  awaiting approval", effects.get("awaitingApproval")),
            ("tombstones (tasks)", stones.get("tasks")),
            ("tombstones (effects)", stones.get("effects")),
            ("events", stats.get("events")),
            ("size", _size(stats.get("bytes"))),
        ]
    )
    detail = stats.get("bytesDetail") or {}
    if isinstance(detail, Mapping) and detail:
        lines += "\n" + fields([(f"  {name}", _size(n)) for name, n in sorted(detail.items())])
    if retention.get("enabled") is False:
        lines += "\nretention is off ([retention] enabled = false): nothing is ever removed"
    return lines
