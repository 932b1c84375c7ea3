"""The change feed of the Redis Cluster store (``ledger.cluster_feed``): one stream per bucket,
merged, with a vector position.

What a subscriber relies on: the position it is handed decodes back to exactly what was
encoded, and only that (anything else is 400 naming ``Last-Event-ID``, never a 500 or a wrong
place); resuming from any event's position gives every later event exactly once, in each
bucket's order, however far apart the buckets' clocks are; a position some bucket has trimmed
past, or that is ahead of the newest id some bucket issued (it lost events), is 410. Pure:
the streams are lists here, read as ``events_read.lua`` reads them (the events after a
position, at most a count).

Deterministic: ``derandomize=True`` and no example database, so every run tries the same
cases.
"""

from __future__ import annotations

import base64
import random
from collections.abc import Sequence
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from fencegate.ledger.cluster_feed import (
    BUSY_256_MAX,
    MAX_STREAM_ID_PART,
    PREFIX,
    StreamId,
    Vector,
    decode,
    encode,
    format_id,
    gone,
    max_text_length,
    merge,
    start_vector,
)
from fencegate.ledger.errors import BadRequest, EventsGone
from fencegate.ledger.events import Event

DETERMINISTIC = settings(
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=300,
    suppress_health_check=[HealthCheck.too_slow],
)
REFUSAL = "Last-Event-ID: not an event position this store issued"
NOW_MS = 1_796_041_642_452  # a store time in 2026

PARTS = st.integers(0, MAX_STREAM_ID_PART)
#: Stream ids as they come: never read (0-0), near one another (busy buckets), anywhere.
IDS = st.one_of(
    st.just((0, 0)),
    st.tuples(st.integers(NOW_MS - 5_000, NOW_MS + 5_000), st.integers(0, 300)),
    st.tuples(PARTS, PARTS),
    st.tuples(st.sampled_from([0, MAX_STREAM_ID_PART]), st.sampled_from([0, 1, 2**64 - 1])),
)
VECTORS = st.lists(IDS, min_size=1, max_size=40).map(tuple)


def raw(text: str) -> bytes:
    body = text.removeprefix(PREFIX)
    return base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))


def position(data: bytes) -> str:
    return PREFIX + base64.urlsafe_b64encode(data).decode().rstrip("=")


# --- the position -------------------------------------------------------------------------


@DETERMINISTIC
@given(VECTORS)
def test_every_vector_round_trips(vector: Vector) -> None:
    text = encode(vector)
    assert text.startswith(PREFIX)
    assert len(text) <= max_text_length(len(vector))
    assert decode(text, len(vector)) == vector


@pytest.mark.parametrize("buckets", [1, 2, 3, 256, 16_384])
def test_the_length_bound_is_the_longest_position(buckets: int) -> None:
    """``max_text_length`` is reached (every ms a full 64-bit jump from the one before, every
    seq 64 bits) and not passed, so ``decode`` never refuses a position this store issued."""
    worst = tuple(
        (MAX_STREAM_ID_PART if n % 2 == 0 else 0, MAX_STREAM_ID_PART) for n in range(buckets)
    )
    assert len(encode(worst)) == max_text_length(buckets)
    assert max_text_length(256) == 6_833


def test_a_bucket_never_read_costs_one_byte() -> None:
    assert len(raw(encode(((0, 0),) * 256))) == 2 + 256  # the count (a 2-byte varint), 1 each
    busy = ((NOW_MS, 0), (NOW_MS + 1, 0))
    spread = ((NOW_MS, 0), (0, 0), (0, 0), (NOW_MS + 1, 0))
    assert len(raw(encode(spread))) == len(raw(encode(busy))) + 2


def test_size_for_256_busy_buckets() -> None:
    """Every bucket busy: last events within 4,095 ms of the previous bucket's, seq at most
    128. The worst of that class is ``BUSY_256_MAX`` (1,037 characters, well inside aiohttp's
    8 KiB header line); a typical one is smaller."""
    worst = tuple((NOW_MS + (4_095 if n % 2 else 0), 128) for n in range(256))
    assert len(encode(worst)) == BUSY_256_MAX == 1_037
    draw = random.Random(30)
    typical = tuple(
        (NOW_MS + draw.randint(0, 4_095), draw.choice([0, 0, 1, 2])) for _ in range(256)
    )
    assert len(encode(typical)) <= BUSY_256_MAX


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


THREE = ((NOW_MS, 0), (0, 0), (NOW_MS + 3, 2))
GOOD = raw(encode(THREE))
#: One example of every way a ``Last-Event-ID`` can be wrong (all for a 3-bucket store), and
#: the reason the refusal gives ("" where it gives none: not a position of this format at all).
MALFORMED = {
    "empty": ("", ""),
    "single-Redis position": ("1796041642452-0", "a single-Redis position"),
    "single-Redis start": ("0-0", "a single-Redis position"),
    "no prefix": (encode(THREE).removeprefix(PREFIX), ""),
    "another format": ("c2." + encode(THREE).removeprefix(PREFIX), ""),
    "padding": (encode(THREE) + "=", ""),
    "standard base64 alphabet": (PREFIX + base64.b64encode(b"\x03\xff\xfe\x00").decode(), ""),
    "a space": (encode(THREE)[:6] + " " + encode(THREE)[6:], ""),
    "non-ASCII": (encode(THREE) + "\u00e9", ""),
    "non-ASCII digits": ("\uff11-0", ""),
    "impossible base64 length": (PREFIX + "AAAAA", ""),
    # 15 characters: the last one's low 2 bits are unused (0), and a decoder ignores them
    "nonzero unused bits": (encode(THREE)[:-1] + chr(ord(encode(THREE)[-1]) + 1), ""),
    "another bucket count": (encode(THREE[:2]), "over 2 buckets; this store has 3"),
    "no count": (position(b""), "empty"),
    "nothing after the count": (position(b"\x03"), "cut off"),
    "cut off inside a number": (position(GOOD[:2]), "cut off inside a number"),
    "cut off before the last bucket": (position(GOOD[:-2]), "cut off"),
    "cut off inside a seq": (position(GOOD[:-1]), "cut off"),
    "a byte after the last bucket": (position(GOOD + b"\x00"), "bytes after the last bucket"),
    # the same vector, written longer than encode writes it
    "overlong count": (position(b"\x83\x00" + GOOD[1:]), ""),
    "overlong zero bucket": (position(GOOD[:-3] + b"\x80\x00" + GOOD[-2:]), ""),
    "a number past 10 bytes": (
        position(b"\x03" + b"\xff" * 10 + b"\x01\x00\x00"),
        "a number longer than any entry holds",
    ),
    "a negative ms": (position(b"\x03" + _varint(3) + b"\x00\x00"), "out of range"),  # 0 - 1
    "an ms past 64 bits": (
        position(b"\x03" + _varint((2**65 << 1) + 1) + b"\x00\x00"),  # 0 + 2**64
        "out of range",
    ),
    "a seq past 64 bits": (
        position(b"\x03" + _varint(2) + _varint(2**64 - 1) + b"\x00\x00"),  # ms 0, seq 2**64
        "out of range",
    ),
    "oversize": (PREFIX + "A" * (max_text_length(3) - len(PREFIX) + 1), "longer than the 85"),
}


@pytest.mark.parametrize(("text", "reason"), MALFORMED.values(), ids=list(MALFORMED))
def test_every_malformed_position_is_refused_naming_last_event_id(text: str, reason: str) -> None:
    assert decode(encode(THREE), 3) == THREE  # the near-misses are near a good one
    with pytest.raises(BadRequest) as refused:
        decode(text, 3)
    assert refused.value.detail.startswith(REFUSAL)
    assert (reason in refused.value.detail) if reason else refused.value.detail == REFUSAL


def test_refusals_say_why_when_it_helps() -> None:
    with pytest.raises(BadRequest, match=r"a single-Redis position"):
        decode("1796041642452-0", 256)
    with pytest.raises(BadRequest, match=r"a position over 2 buckets; this store has 3"):
        decode(encode(THREE[:2]), 3)
    with pytest.raises(BadRequest, match=r"longer than the 6833 characters"):
        decode(PREFIX + "A" * 7_000, 256)


#: Anything a client could send, and mangled good positions.
TEXTS = st.one_of(
    st.text(max_size=80),
    st.builds(position, st.binary(max_size=60)),
    st.builds(lambda v, cut: encode(v)[:cut], VECTORS, st.integers(0, 200)),
)


@DETERMINISTIC
@given(TEXTS, st.integers(1, 40))
def test_only_what_encode_writes_decodes(text: str, buckets: int) -> None:
    try:
        vector = decode(text, buckets)
    except BadRequest as exc:
        assert exc.detail.startswith(REFUSAL)
    else:
        assert encode(vector) == text


# --- the merge ----------------------------------------------------------------------------


def _stream(base: int, steps: Sequence[int]) -> list[StreamId]:
    """A bucket's ids from its own clock: a step of 0 ms is the next seq in the same ms."""
    ids: list[StreamId] = []
    ms, seq = base, 0
    for step in steps:
        ms, seq = (ms, seq + 1) if step == 0 else (ms + step, 0)
        ids.append((ms, seq))
    return ids


#: Buckets' clocks far apart: a bucket at the epoch, one at now, one near the top of 64 bits.
BASES = st.sampled_from([0, 7, 10**6, NOW_MS, 2**63])
STREAMS = st.lists(
    st.builds(_stream, BASES, st.lists(st.sampled_from([0, 0, 1, 3, 1_000]), max_size=12)),
    min_size=1,
    max_size=6,
)

Delivered = tuple[int, StreamId]  # (bucket, stream id): what identifies an event


def read(
    streams: Sequence[Sequence[StreamId]], after: Vector, limit: int, count: int
) -> tuple[list[Event], Vector]:
    """What the cluster store does: each bucket's events after its position, at most
    ``count`` (as ``events_read.lua`` answers), merged."""
    pages: dict[int, list[tuple[str, dict[str, Any]]]] = {}
    truncated = set()
    for bucket, stream in enumerate(streams):
        rest = [i for i in stream if i > after[bucket]]
        pages[bucket] = [(format_id(i), {"bucket": bucket, "id": i}) for i in rest[:count]]
        if len(rest) > count:
            truncated.add(bucket)
    return merge(after, pages, limit, truncated=truncated)


def drain(
    streams: Sequence[Sequence[StreamId]], after: Vector, limit: int, count: int
) -> list[Event]:
    out: list[Event] = []
    for _ in range(sum(map(len, streams)) + 1):
        events, end = read(streams, after, limit, count)
        check_positions(after, events, end)
        if not events:
            return out
        out += events
        after = end
    raise AssertionError("the reads made no progress")


def check_positions(after: Vector, events: Sequence[Event], end: Vector) -> None:
    """Each event's position is the vector before it with its own bucket moved to its id
    (encoded as ``encode`` encodes it); ``end`` is the last event's, or ``after``."""
    vector = list(after)
    for event in events:
        vector[event.body["bucket"]] = event.body["id"]
        assert event.position == encode(tuple(vector))
        assert decode(event.position, len(after)) == tuple(vector)
    assert end == tuple(vector)


def ident(event: Event) -> Delivered:
    return event.body["bucket"], event.body["id"]


def check_exactly_once(streams: Sequence[Sequence[StreamId]], got: Sequence[Delivered]) -> None:
    assert len(got) == len(set(got)), "an event came twice"
    for bucket, stream in enumerate(streams):
        assert [i for b, i in got if b == bucket] == list(stream), f"bucket {bucket}"


def key(item: Delivered) -> tuple[StreamId, int]:
    return item[1], item[0]


@DETERMINISTIC
@given(STREAMS, st.integers(1, 8), st.integers(1, 8), st.data())
def test_resuming_from_any_event_gives_every_later_event_once(
    streams: list[list[StreamId]], limit: int, count: int, data: st.DataObject
) -> None:
    """All events written, then read in pages: every event once, per-bucket order kept, and
    (the pages' ``truncated`` honoured) in (ms, seq, bucket) order across buckets. Then a
    subscriber that stopped after any event and resumes from its position, with other page
    sizes, gets exactly the rest."""
    start: Vector = ((0, 0),) * len(streams)
    delivered = drain(streams, start, limit, count)
    got = [ident(e) for e in delivered]
    check_exactly_once(streams, got)
    assert got == sorted(got, key=key)
    for split, event in enumerate(delivered):
        resumed = drain(
            streams,
            decode(event.position, len(streams)),
            data.draw(st.integers(1, 8)),
            data.draw(st.integers(1, 8)),
        )
        check_exactly_once(streams, got[: split + 1] + [ident(e) for e in resumed])


ACTIONS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(0, 3), st.sampled_from([0, 1, 5, 10**9])),
        st.tuples(st.just("read"), st.integers(0, 6), st.integers(1, 6)),
    ),
    max_size=40,
)


@DETERMINISTIC
@given(st.lists(BASES, min_size=4, max_size=4), ACTIONS, st.data())
def test_a_live_feed_misses_nothing_whatever_the_clocks(
    bases: list[int], actions: list[tuple[str, int, int]], data: st.DataObject
) -> None:
    """Events appended while a subscriber reads, each bucket on its own clock (one may lag
    the others by years): a bucket behind is never skipped. Resume from any event: the union
    is every event, none twice."""
    streams: list[list[StreamId]] = [[] for _ in bases]
    clocks = [(base, 0) for base in bases]
    after: Vector = ((0, 0),) * len(bases)
    delivered: list[Event] = []
    for action, a, b in actions:
        if action == "append":
            ms, seq = clocks[a]
            clocks[a] = (ms, seq + 1) if b == 0 else (ms + b, 0)
            streams[a].append(clocks[a])
        else:
            events, end = read(streams, after, a, b)
            check_positions(after, events, end)
            delivered += events
            after = end
    delivered += drain(streams, after, 5, 3)
    got = [ident(e) for e in delivered]
    check_exactly_once(streams, got)
    if delivered:
        split = data.draw(st.integers(0, len(delivered) - 1))
        resumed = drain(streams, decode(delivered[split].position, len(bases)), 4, 2)
        check_exactly_once(streams, got[: split + 1] + [ident(e) for e in resumed])


def test_a_lagging_bucket_is_not_skipped() -> None:
    """Bucket 1's primary is a day behind: its later events have smaller ids than bucket 0's
    already delivered ones, and still come, once."""
    day = 86_400_000
    streams = [[(NOW_MS, 0)], [(NOW_MS - day, 0)]]
    events, after = read(streams, ((0, 0), (0, 0)), 10, 10)
    assert [ident(e) for e in events] == [(1, (NOW_MS - day, 0)), (0, (NOW_MS, 0))]
    streams[1].append((NOW_MS - day + 5, 0))
    events, after = read(streams, after, 10, 10)
    assert [ident(e) for e in events] == [(1, (NOW_MS - day + 5, 0))]
    assert after == ((NOW_MS, 0), (NOW_MS - day + 5, 0))


def test_a_bucket_without_events_keeps_its_position() -> None:
    after: Vector = ((5, 0), (9, 1), (0, 0))
    events, end = merge(after, {0: [("6-0", {"n": 1})], 1: []}, 10)
    assert len(events) == 1
    assert end == ((6, 0), (9, 1), (0, 0))
    assert merge(after, {}, 10) == ([], after)
    assert merge(after, {0: [("6-0", {"n": 1})]}, 0) == ([], after)


def test_a_short_page_holds_back_later_events_of_other_buckets() -> None:
    """Bucket 0 was read 2 events deep and has more: bucket 1's event at ms 50 waits, since
    bucket 0's unread events may come before it; bucket 1's at ms 2 does not."""
    pages = {0: [("1-0", {}), ("3-0", {})], 1: [("2-0", {}), ("50-0", {})]}
    events, end = merge(((0, 0), (0, 0)), pages, 10, truncated={0})
    assert end == ((3, 0), (2, 0))
    assert len(events) == 3


@pytest.mark.parametrize(
    ("pages", "words"),
    [
        ({0: [("5-0", {})]}, "not after 5-0"),
        ({1: [("7-0", {}), ("7-0", {})]}, "not after 7-0"),
        ({1: [("8-0", {}), ("7-9", {})]}, "not after 8-0"),
        ({2: [("9-0", {})]}, "no bucket 2"),
        ({0: [("6", {})]}, "not a stream id"),
    ],
)
def test_a_page_out_of_order_is_a_store_fault(
    pages: dict[int, list[tuple[str, dict[str, Any]]]], words: str
) -> None:
    with pytest.raises(ValueError, match=words):
        merge(((5, 0), (0, 0)), pages, 10)


# --- from now, and trimmed away -------------------------------------------------------------


def test_from_now_is_every_buckets_last_id() -> None:
    assert start_vector(["1796041642452-3", "0-0"]) == ((NOW_MS, 3), (0, 0))
    with pytest.raises(ValueError):
        start_vector(["1796041642452"])


@DETERMINISTIC
@given(st.lists(st.tuples(IDS, IDS, IDS), min_size=1, max_size=8), st.data())
def test_gone_is_the_rule_of_every_store_per_bucket(
    triples: list[tuple[StreamId, StreamId, StreamId]], data: st.DataObject
) -> None:
    """``events.gone`` per bucket read: below the bucket's max deleted id (trimmed away) or
    above its last generated id (ahead of the newest it issued); the lowest such bucket."""
    after = tuple(a for a, _, _ in triples)
    read_buckets = data.draw(st.sets(st.integers(0, len(triples) - 1)))
    # A stream's max deleted id is never above its last generated id.
    ends = {b: (min(triples[b][1:]), max(triples[b][1:])) for b in read_buckets}
    trimmed = {b: format_id(ends[b][0]) for b in read_buckets}
    newest = {b: format_id(ends[b][1]) for b in read_buckets}
    expected = sorted(b for b in read_buckets if not ends[b][0] <= after[b] <= ends[b][1])
    found = gone(after, trimmed, newest)
    if not expected:
        assert found is None
    else:
        first = expected[0]
        why = "events up to position" if after[first] < ends[first][0] else "is ahead of the"
        assert isinstance(found, EventsGone)
        assert found.detail.startswith(f"bucket {first}: ") and why in found.detail


def test_gone_compares_numbers_not_text() -> None:
    assert gone(((10, 0),), {0: "9-5"}, {0: "10-0"}) is None  # "10-0" < "9-5" as text
    assert gone(((9, 5),), {0: "9-5"}, {0: "10-0"}) is None  # at the last dropped one
    refused = gone(((0, 0), (9, 5)), {0: "0-0", 1: "10-0"}, {0: "0-0", 1: "11-0"})
    assert refused is not None and refused.code == "EVENTS_GONE" and refused.status == 410
    assert refused.detail.startswith("bucket 1: events up to position 10-0 were dropped")
    ahead = gone(((10, 0),), {0: "0-0"}, {0: "9-5"})  # "10-0" < "9-5" as text
    assert ahead is not None and "position 10-0 is ahead of the newest" in ahead.detail


def test_a_place_ahead_of_its_buckets_newest_id_is_gone() -> None:
    """A bucket whose stream lost events it had issued (a failover that lost writes, an older
    copy restored) answers a last generated id below the subscriber's place there: 410, not a
    wait that would skip what the bucket writes next up to that place. At its last generated
    id nothing is missing (nothing came after it yet)."""
    none_trimmed = {0: "0-0", 1: "0-0"}
    ends = {0: f"{NOW_MS}-0", 1: "0-0"}  # bucket 1 never written: its stream does not exist
    assert gone(((NOW_MS, 0), (0, 0)), none_trimmed, ends) is None
    refused = gone(((NOW_MS, 1), (0, 0)), none_trimmed, ends)
    assert refused is not None and refused.code == "EVENTS_GONE" and refused.status == 410
    assert refused.detail.startswith(
        f"bucket 0: position {NOW_MS}-1 is ahead of the newest event this store has issued "
        f"(position {NOW_MS}-0): the store lost events it had issued"
    )
    refused = gone(((NOW_MS, 0), (1, 0)), none_trimmed, ends)
    assert refused is not None and refused.detail.startswith("bucket 1: position 1-0 is ahead")
