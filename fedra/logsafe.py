"""Text from a remote party made safe to log: control characters escaped, length bounded.

A site or an admin chooses the ids, reasons and names it sends; logged as they are, a
newline forges a log line, an escape sequence rewrites the operator's terminal, and a
megabyte-long id floods the log. Everything that may quote them goes through ``safe``.
"""

from __future__ import annotations

import traceback

LOG_CHARS = 200  # the most characters of one remote value in a log line
MESSAGE_CHARS = 400  # of a refusal's message, which may quote one or two such values
STATUS_CHARS = 1000  # the most characters of a status message sent back to the caller


def _escaped(char: str) -> str:
    if char.isprintable():
        return char
    # \n, \t, \x1b, \u202e (a bidi override): visible, and never a line break.
    return char.encode("unicode_escape").decode("ascii")


def safe(text: object, limit: int = LOG_CHARS) -> str:
    """``str(text)`` with non-printable characters escaped, cut to ``limit`` characters
    (then ``...`` and the original length follow)."""
    s = str(text)
    if len(s) <= limit and s.isprintable():
        return s
    out: list[str] = []
    size = 0
    for char in s[: limit + 1]:  # each character takes at least one: no more are needed
        piece = _escaped(char)
        if size + len(piece) > limit:
            return "".join(out) + f"... ({len(s)} characters)"
        out.append(piece)
        size += len(piece)
    return "".join(out)


def exception_text(exc: BaseException, limit: int = MESSAGE_CHARS) -> str:
    """A traceback of ``exc`` and the exceptions that led to it, each message made safe:
    the frames are the program's own, the messages may quote a remote party."""
    parts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if parts:
            parts.append("which was raised while handling (or caused by):\n")
        parts.append("Traceback (most recent call last):\n")
        parts.extend(traceback.format_tb(current.__traceback__))
        parts.append(f"{type(current).__name__}: {safe(current, limit)}\n")
        context = None if current.__suppress_context__ else current.__context__
        current = current.__cause__ or context
    return "".join(parts).rstrip("\n")
