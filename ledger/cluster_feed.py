"""The change feed on the Redis Cluster store: one stream per bucket, merged into one feed.

Every step appends its events to its own bucket's stream in the script that made the change
(``ledger.events``; docs/decisions.md, "Issue 30: Redis Cluster, the design", "Change feed"),
so the store has ``B`` streams (``ledger.buckets``), each ordered by its stream ids
``<ms>-<seq>``, which only the bucket's primary hands out. A subscriber's place is therefore
a **vector**: the stream id it has read up to in every bucket (``0-0`` for a bucket it has
read nothing of). This module is that vector and the merge, with no I/O: the cluster store
reads each bucket's page (``events_read.lua``, unchanged, from the bucket's own position) and
hands the pages here.

- **The position** (``encode`` / ``decode``): ``c1.`` then base64url (no padding) of the
  bucket count and each bucket's ``(ms, seq)`` as varints, each ms delta-coded against the
  previous bucket that has one (busy buckets' last events are close in time), a bucket at
  ``0-0`` in one byte. Only what ``encode`` writes decodes; anything else, a vector over
  another bucket count and a single-Redis position are ``BadRequest`` naming
  ``Last-Event-ID``, as ``RedisStore.read_events`` words it. Size: 256 buckets whose last
  events lie within 4 s of each other take at most 1,037 characters (``BUSY_256_MAX``;
  ``tests/test_cluster_feed.py`` measures it), a bucket never written 1 byte (4/3 of a
  character); the most any vector can take is ``max_text_length`` (6,833 characters for 256
  buckets), which is what ``decode`` bounds its input by. Every SSE frame carries one, so a
  frame costs up to a kilobyte more than on one Redis. Past about 2,000 busy buckets a
  position outgrows aiohttp's 8 KiB limit on a header line (``Last-Event-ID``).
- **The merge** (``merge``): the pages interleaved in ``(ms, seq, bucket)`` order, at most
  ``limit``, each event carrying the position *after it* (the vector with only its own bucket
  advanced to its id). Resuming from any event's position reads every bucket from its own
  place, so every later event comes exactly once, whatever the buckets' clocks: a bucket
  whose clock lags is not skipped, its position only moves past what was delivered. Order is
  per bucket (so per task and per task group); across buckets as good as the primaries'
  clocks.
- **From now** (``start_vector``) and **gone** (``gone``: ``events.gone``, the rule every
  store applies, per bucket: a place trimmed away, or one ahead of the bucket's last
  generated id, which only a loss of events it had issued makes possible).
"""

from __future__ import annotations

import base64
import binascii
import heapq
import re
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

from fencegate.ledger import events
from fencegate.ledger.errors import BadRequest, EventsGone
from fencegate.ledger.events import Event

__all__ = [
    "BUSY_256_MAX",
    "MAX_STREAM_ID_PART",
    "PREFIX",
    "StreamId",
    "Vector",
    "decode",
    "encode",
    "format_id",
    "gone",
    "max_text_length",
    "merge",
    "parse_id",
    "start_vector",
]

#: A stream id ``<ms>-<seq>`` as numbers; ordered as Redis orders them.
StreamId = tuple[int, int]
#: A position on the cluster store: bucket n's stream id at index n.
Vector = tuple[StreamId, ...]

#: What every cluster position starts with: ``c`` for cluster, ``1`` the format. A
#: single-Redis position (``<ms>-<seq>``) never does, so neither store takes the other's.
PREFIX = "c1."
#: Each part of a stream id is an unsigned 64-bit number in Redis.
MAX_STREAM_ID_PART = 2**64 - 1
#: The longest ``encode`` writes for 256 buckets whose last events lie within 4,095 ms of the
#: previous bucket's and whose sequence numbers are at most 128 (every bucket busy): 2 bytes
#: for the count, 8 for the first entry (7 for an absolute ms before the year 6429, 1 for its
#: seq), 3 for each other: 775 bytes, 1,034 characters of base64, and the prefix.
BUSY_256_MAX = 1_037

_ZERO: StreamId = (0, 0)
_ID = re.compile(r"([0-9]{1,20})-([0-9]{1,20})")
_BASE64URL = re.compile(r"[A-Za-z0-9_-]*")
#: The longest varint an entry holds: a tag is below 2**66 (a delta of up to 2**64 - 1 either
#: way, zig-zagged, shifted by one bit), a seq below 2**64; 7 bits a byte.
_MAX_VARINT_BYTES = 10
#: The most one bucket's entry takes: its tag and its seq, each at most 10 bytes.
_MAX_ENTRY_BYTES = 2 * _MAX_VARINT_BYTES
_REFUSAL = "Last-Event-ID: not an event position this store issued"


def parse_id(text: str) -> StreamId:
    """A stream id as Redis writes it (``1796041642452-0``) as numbers; ValueError otherwise.

    Ids come from the store's own replies (``events_read.lua``), so a bad one is a store
    fault, not a client's: a ValueError, never a 400."""
    match = _ID.fullmatch(text)
    if match is None or max(int(match[1]), int(match[2])) > MAX_STREAM_ID_PART:
        raise ValueError(f"not a stream id: {text!r}")
    return int(match[1]), int(match[2])


def format_id(stream_id: StreamId) -> str:
    return f"{stream_id[0]}-{stream_id[1]}"


# --- the position ---------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _entry(stream_id: StreamId, ref: int) -> bytes:
    """One bucket's bytes: ``0`` for ``0-0``; else a tag (the ms as a zig-zagged delta from
    ``ref``, the previous non-zero bucket's ms, then one bit "seq follows"), plus one, and the
    seq less one when it is not 0 (most last events are a step's first append: seq 0)."""
    ms, seq = stream_id
    if stream_id == _ZERO:
        return b"\x00"
    delta = ms - ref
    zigzag = 2 * delta if delta >= 0 else -2 * delta - 1
    tag = (zigzag << 1 | (seq != 0)) + 1
    return _varint(tag) + (_varint(seq - 1) if seq else b"")


class _Encoder:
    """A vector's encoding kept as one chunk per bucket, so advancing one bucket re-encodes
    two chunks (its own and the next non-zero bucket's, whose delta is against it) instead of
    all ``B``: ``merge`` gives every event its own position."""

    def __init__(self, vector: Vector) -> None:
        self.vector = list(vector)
        self.chunks = [_varint(len(vector))]
        ref = 0
        for stream_id in vector:
            self.chunks.append(_entry(stream_id, ref))
            if stream_id != _ZERO:
                ref = stream_id[0]

    def _ref(self, bucket: int) -> int:
        """The ms bucket ``bucket``'s entry is delta-coded against."""
        for earlier in range(bucket - 1, -1, -1):
            if self.vector[earlier] != _ZERO:
                return self.vector[earlier][0]
        return 0

    def advance(self, bucket: int, stream_id: StreamId) -> None:
        """Move ``bucket`` to ``stream_id``, an id after its current one (so never ``0-0``)."""
        self.vector[bucket] = stream_id
        self.chunks[bucket + 1] = _entry(stream_id, self._ref(bucket))
        for later in range(bucket + 1, len(self.vector)):
            if self.vector[later] != _ZERO:
                self.chunks[later + 1] = _entry(self.vector[later], stream_id[0])
                break

    def text(self) -> str:
        return PREFIX + base64.urlsafe_b64encode(b"".join(self.chunks)).decode().rstrip("=")


def encode(vector: Vector) -> str:
    """The position a subscriber sends back (``id:`` of the SSE frame, ``Last-Event-ID``)."""
    for ms, seq in vector:
        if not (0 <= ms <= MAX_STREAM_ID_PART and 0 <= seq <= MAX_STREAM_ID_PART):
            raise ValueError(f"not a stream id: {ms}-{seq}")
    return _Encoder(vector).text()


def max_text_length(buckets: int) -> int:
    """The longest position ``encode`` writes for ``buckets`` buckets: the prefix, then the
    base64 of the count and ``buckets`` entries of at most 20 bytes (every ms a full 64-bit
    jump from the previous one, every seq 64 bits). ``decode`` refuses longer text before it
    decodes anything, so a client cannot make the gateway decode megabytes."""
    raw = len(_varint(buckets)) + _MAX_ENTRY_BYTES * buckets
    return len(PREFIX) + (4 * raw + 2) // 3


class _Malformed(Exception):
    """Bytes that are not an encoded vector (turned into the one refusal by ``decode``)."""


def _read_varints(raw: bytes) -> Iterator[int]:
    value = shift = size = 0
    for byte in raw:
        value |= (byte & 0x7F) << shift
        shift += 7
        size += 1
        if size > _MAX_VARINT_BYTES:
            raise _Malformed("a number longer than any entry holds")
        if not byte & 0x80:
            yield value
            value = shift = size = 0
    if size:
        raise _Malformed("cut off inside a number")


def _decode_bytes(raw: bytes, buckets: int) -> Vector:
    numbers = _read_varints(raw)
    count = next(numbers, None)
    if count is None:
        raise _Malformed("empty")
    if count != buckets:
        raise _Malformed(f"a position over {count} buckets; this store has {buckets}")
    vector: list[StreamId] = []
    ref = 0
    for _ in range(buckets):
        tag = next(numbers, None)
        if tag is None:
            raise _Malformed("cut off")
        if tag == 0:
            vector.append(_ZERO)
            continue
        tag -= 1
        zigzag, has_seq = tag >> 1, tag & 1
        delta = zigzag >> 1 if not zigzag & 1 else -((zigzag + 1) >> 1)
        ms = ref + delta
        seq = 0
        if has_seq:
            more = next(numbers, None)
            if more is None:
                raise _Malformed("cut off")
            seq = more + 1
        if not (0 <= ms <= MAX_STREAM_ID_PART and seq <= MAX_STREAM_ID_PART):
            raise _Malformed("a stream id out of range")
        vector.append((ms, seq))
        ref = ms
    if next(numbers, None) is not None:
        raise _Malformed("bytes after the last bucket")
    return tuple(vector)


def decode(text: str, buckets: int) -> Vector:
    """The vector ``text`` names, if ``encode`` wrote exactly ``text`` for a store of
    ``buckets`` buckets; ``BadRequest`` naming ``Last-Event-ID`` otherwise: malformed,
    longer than ``max_text_length(buckets)``, another bucket count (a store copied to another
    count keeps no position valid), a single-Redis position, or one that decodes but is not
    the canonical form (padding, an overlong number: not a position this store issued)."""
    if len(text) > max_text_length(buckets):
        raise BadRequest(
            f"{_REFUSAL} (longer than the {max_text_length(buckets)} characters any position "
            f"over {buckets} buckets takes)"
        )
    if _ID.fullmatch(text):
        raise BadRequest(f"{_REFUSAL} (a single-Redis position; this store is a cluster's)")
    body = text.removeprefix(PREFIX)
    if body == text or not _BASE64URL.fullmatch(body):
        raise BadRequest(_REFUSAL)
    try:
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        vector = _decode_bytes(raw, buckets)
    except binascii.Error:
        raise BadRequest(_REFUSAL) from None
    except _Malformed as exc:
        raise BadRequest(f"{_REFUSAL} ({exc})") from None
    if encode(vector) != text:
        raise BadRequest(_REFUSAL)
    return vector


# --- reading ---------------------------------------------------------------------------------


def start_vector(last_ids: Sequence[str]) -> Vector:
    """ "From now": every bucket's last generated id (``events_read.lua`` with no position
    answers it; ``0-0`` for a bucket with no stream yet), bucket n's at index n."""
    return tuple(parse_id(last) for last in last_ids)


def gone(after: Vector, trimmed: Mapping[int, str], newest: Mapping[int, str]) -> EventsGone | None:
    """``EventsGone`` (410) when a bucket's position is gone by ``events.gone``'s rule: below
    its stream's ``max-deleted-entry-id`` (``trimmed``) or above its ``last-generated-id``
    (``newest``), both as ``events_read.lua`` answers them, for the buckets read (the keys of
    ``trimmed``), naming the lowest such bucket as the cluster store does; None when every
    event after ``after`` is still to come. On numbers (``9-0`` is below ``10-0``), as each
    bucket's ``read_events`` decides, so a bucket the store refuses is refused here too.
    Returned, not raised: the caller raises it."""
    for bucket in sorted(trimmed):
        refused = events.gone(
            after[bucket], dropped=parse_id(trimmed[bucket]), newest=parse_id(newest[bucket])
        )
        if refused is not None:
            return EventsGone(f"bucket {bucket}: {refused.detail}")
    return None


def merge(
    after: Vector,
    pages: Mapping[int, Sequence[tuple[str, dict[str, Any]]]],
    limit: int,
    *,
    truncated: Collection[int] = (),
) -> tuple[list[Event], Vector]:
    """The events of ``pages`` (bucket -> its events after ``after[bucket]``, in stream order,
    as ``(stream id, body)``) in ``(ms, seq, bucket)`` order, at most ``limit``, each with
    the position after it; and the vector to go on from (each bucket at its last delivered
    event, a bucket none of whose events were delivered where it was).

    ``truncated`` names the buckets whose page may stop short of their stream's end (read
    with a smaller count than ``limit``): nothing is delivered past the earliest of their last
    ids, since their unread events may come before it. Exactness never depends on it (every
    bucket resumes from its own id); only the order across buckets does. At least one event is
    delivered whenever a page has one.

    A page that is not after its bucket's position or not in stream order is a store fault:
    ValueError."""
    if limit < 0:
        raise ValueError(f"limit must be 0 or more, got {limit}")
    keyed: list[list[tuple[StreamId, int, dict[str, Any]]]] = []
    stop: tuple[StreamId, int] | None = None
    for bucket, page in pages.items():
        if not 0 <= bucket < len(after):
            raise ValueError(f"no bucket {bucket} in a vector over {len(after)} buckets")
        previous = after[bucket]
        entries: list[tuple[StreamId, int, dict[str, Any]]] = []
        for raw_id, body in page:
            stream_id = parse_id(raw_id)
            if stream_id <= previous:
                raise ValueError(
                    f"bucket {bucket}: {raw_id} is not after {format_id(previous)} (a page "
                    "must hold the bucket's events after its position, in stream order)"
                )
            entries.append((stream_id, bucket, body))
            previous = stream_id
        if entries:
            keyed.append(entries)
            if bucket in truncated:
                last = (entries[-1][0], bucket)
                stop = last if stop is None else min(stop, last)
    encoder = _Encoder(after)
    events: list[Event] = []
    for stream_id, bucket, body in heapq.merge(*keyed, key=lambda e: (e[0], e[1])):
        if len(events) == limit or (stop is not None and (stream_id, bucket) > stop):
            break
        encoder.advance(bucket, stream_id)
        events.append(Event(position=encoder.text(), body=body))
    return events, tuple(encoder.vector)
