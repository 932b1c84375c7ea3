"""Which path segments could take a request out of a downstream's base path, judged as the
most lenient server behind the gateway would read them (docs/security.md, "Paths").

One rule for every path the gateway sends that a client had a hand in: ``/proxy`` tails
(``gateway/http_rules.split_proxy_path``) and expanded probe paths (``adapters/kinds``).

Servers read a segment in ways the gateway's own URL handling does not:

* Java servlet containers (Tomcat, Jetty) drop a segment's path parameters (``;`` to the end
  of the segment) before normalising, so ``..;`` and ``..;x=1`` are ``..`` there: a real Tomcat
  served ``/proxy/reports/..;/admin/wipe`` from ``/admin``;
* a server (or a proxy in front of it) may percent-decode more than once, so ``%252e%252e``
  ends up ``..`` and ``%252f`` a ``/``;
* IIS decodes ``%u002e``; some stacks fold Unicode compatibility forms, so U+FF0E FULLWIDTH
  FULL STOP reads as ``.`` (and U+2025 TWO DOT LEADER as ``..``).

So a segment is judged by its *core*: cut at its first ``;``, NFKC normalised, decoded
(``%XX`` and ``%uXXXX``), round after round until nothing changes. A segment escapes when
its core, split at ``/``, ``\\`` and NUL (which a server that decodes them would split or
stop at), has a ``.`` or ``..`` piece: ``%252e%252e`` and ``..%2Fx`` do, ``a%2Fb`` (a name
with a slash, as a probe template encodes it) does not.
Pure: ``tests/test_path_confinement.py``.
"""

from __future__ import annotations

import re
import unicodedata
from urllib.parse import unquote

__all__ = ["escapes_base", "segment_core"]

#: IIS's ``%uXXXX`` escape.
_PERCENT_U = re.compile(r"%[uU]([0-9a-fA-F]{4})")
#: A segment nothing can turn into another: no ``%``, ``;``, ``.`` nor anything non-ASCII.
_PLAIN = re.compile(r"[A-Za-z0-9_~@:,=+!$&'()*-]*")
#: Rounds of decoding ``segment_core`` follows (a name encoded deeper is refused).
_ROUNDS = 8
#: Where a server that decoded them would split a core (or a C string would end).
_SEPARATORS = re.compile(r"[/\\\x00]")


def _decode_once(text: str) -> str:
    return unquote(_PERCENT_U.sub(lambda m: chr(int(m[1], 16)), text))


def segment_core(segment: str) -> str | None:
    """What the most lenient server could take ``segment`` for (see the module docstring);
    None when it is still changing after ``_ROUNDS`` rounds (judged as escaping: no real
    name is encoded that deep). NFKC runs in every round, since a FULLWIDTH PERCENT SIGN becomes
    a ``%`` that the next round decodes."""
    text = segment
    for _ in range(_ROUNDS):
        core = _decode_once(unicodedata.normalize("NFKC", text.split(";", 1)[0]))
        core = unicodedata.normalize("NFKC", core.split(";", 1)[0])
        if core == text:
            return core
        text = core
    return None


def escapes_base(segment: str) -> bool:
    """Whether some server could read ``segment`` (one ``/``-separated piece of a path, still
    percent-encoded) as, or as holding, a ``.`` or ``..`` segment."""
    if _PLAIN.fullmatch(segment):  # the common case, at little cost
        return False
    core = segment_core(segment)
    return core is None or any(piece in (".", "..") for piece in _SEPARATORS.split(core))
