"""How fedra's processes write their logs: plain text lines (the default), or one JSON
object a line (``--log-format json``) for a log shipper to index.

A JSON line has ``time`` (UTC, ISO 8601, milliseconds), ``level``, ``component`` (the
logger: ``fedra.coordinator``, ``fedra.site``, ...), ``message`` (the same text as the
plain line's), ``exception`` when one is logged, and what the line is about when the
code that logs it knows: ``run``, ``round``, ``site`` (and ``rank`` in a site's parallel
workers). Those come from ``about`` / ``set_about``, which the round driver and the site
agent set for the thread (or asyncio task) they run in, or from a log call's ``extra``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime, timezone
from types import MappingProxyType

FORMATS = ("text", "json")
ENV = "FEDRA_LOG_FORMAT"  # the default of --log-format; children of a process inherit it
KEYS = ("run", "round", "site", "rank")  # what a line may be about, in this order
TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"

_NOTHING: Mapping[str, object] = MappingProxyType({})
_ABOUT: ContextVar[Mapping[str, object]] = ContextVar("fedra_log_about", default=_NOTHING)


def _with(fields: Mapping[str, object]) -> Mapping[str, object]:
    merged = {**_ABOUT.get(), **fields}
    return MappingProxyType({k: v for k, v in merged.items() if v is not None})


def set_about(**fields: object) -> None:
    """What the lines logged from here on in this thread (or asyncio task) are about;
    a field set to None is dropped."""
    _ABOUT.set(_with(fields))


@contextmanager
def about(**fields: object) -> Iterator[None]:
    """``set_about`` for the lines logged inside the ``with`` block only."""
    token = _ABOUT.set(_with(fields))
    try:
        yield
    finally:
        _ABOUT.reset(token)


class JsonLines(logging.Formatter):
    """A record as one line of JSON (escaped: a remote party's text never breaks a line)."""

    def __init__(self, static: Mapping[str, object] | None = None) -> None:
        super().__init__()
        self.static = dict(static or {})

    def format(self, record: logging.LogRecord) -> str:
        created = datetime.fromtimestamp(record.created, timezone.utc)
        doc: dict[str, object] = {
            "time": created.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "component": record.name,
        }
        context = {**self.static, **_ABOUT.get()}
        for key in KEYS:
            value = getattr(record, key, context.get(key))  # a call's extra= comes first
            if value is not None:
                doc[key] = value
        doc["message"] = record.getMessage()
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        elif record.stack_info:
            doc["exception"] = self.formatStack(record.stack_info)
        return json.dumps(doc, default=str)


def check_format(name: str) -> str:
    """``name`` if it is a log format; ValueError naming the choices otherwise."""
    if name not in FORMATS:
        raise ValueError(f"log format: {name!r} is not one of {', '.join(FORMATS)}")
    return name


def setup(
    level: str,
    log_format: str,
    text_format: str = TEXT_FORMAT,
    static: Mapping[str, object] | None = None,
) -> None:
    """Log to stderr at ``level`` in ``log_format`` (as ``logging.basicConfig`` does:
    not if the process has configured logging already); the processes this one starts
    (a site's parallel workers) inherit the format through the environment."""
    check_format(log_format)
    if logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonLines(static))
        logging.captureWarnings(True)  # a library's warning is a line of JSON too
    else:
        handler.setFormatter(logging.Formatter(text_format))
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler])
    logging.getLogger("alembic").setLevel(logging.WARNING)
    os.environ[ENV] = log_format
