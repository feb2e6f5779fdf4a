"""Writes of a group commit, and how a batch of them runs in one transaction.

A write (``WriteOp``) is a callable on the batch's session. Most writes on the paths
sites wait on are one prebuilt statement each (an update accepted, a registration, a
ledger event): as ``StatementWrite`` they say so, and a batch runs the writes of each
statement as one ``executemany`` instead of a statement each. At a
thousand sites a round that is a thousand executions, a thousand compilations' cache
look-ups and result objects fewer: the group commit was a sixth of the coordinator's CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session
from sqlalchemy.sql.expression import Executable

# One write of a group commit (Store.write_batch): it runs in the batch's transaction.
WriteOp = Callable[[Session], None]


class DuplicateError(Exception):
    """A write collided with a uniqueness rule (a reused nonce, a second round row)."""


class StatementWrite:
    """A write that is ``statement`` executed with ``values``. ``rows``: how many rows it
    must change, checked when it runs in a stretch (None: any); ``alone``: how it runs by
    itself, raising its own precise refusal (default: the statement, unchecked)."""

    __slots__ = ("alone", "rows", "statement", "values")

    def __init__(
        self,
        statement: Executable,
        values: Mapping[str, Any],
        *,
        rows: int | None = None,
        alone: WriteOp | None = None,
    ) -> None:
        self.statement, self.values, self.rows, self.alone = statement, values, rows, alone

    def __call__(self, s: Session) -> None:
        if self.alone is not None:
            self.alone(s)
        else:
            s.connection().execute(self.statement, self.values)


def run_batch(s: Session, ops: Sequence[WriteOp]) -> None:
    """Run ``ops`` in ``s``'s transaction, the ``StatementWrite``s of each statement as one
    executemany where the first of them stands (a batch is committed whole, so only
    writes of one statement keep their order among themselves: a ledger event noted with
    each accepted update must not split the accepts into stretches of one). Raises
    DuplicateError when a write of an executemany collided or changed fewer rows than it
    must (which one is not known: the caller runs them again one at a time to learn it),
    and whatever a write alone raises."""
    many = s.get_bind().dialect.supports_sane_multi_rowcount
    for group in _by_statement(ops) if many else [[op] for op in ops]:
        if len(group) == 1:
            group[0](s)
            continue
        writes = [w for w in group if isinstance(w, StatementWrite)]  # all of them
        first = writes[0]
        try:
            result = s.connection().execute(first.statement, [w.values for w in writes])
        except IntegrityError as exc:
            raise DuplicateError("a write of the batch collided with a uniqueness rule") from exc
        if first.rows is not None and result.rowcount != first.rows * len(writes):
            raise DuplicateError("a write of the batch changed fewer rows than it must")


def _by_statement(ops: Sequence[WriteOp]) -> list[list[WriteOp]]:
    """``ops`` in order, each ``StatementWrite`` moved into the group of the first write of
    its statement (and row rule); any other write a group of its own."""
    groups: list[list[WriteOp]] = []
    by_key: dict[tuple[int, int | None], list[WriteOp]] = {}
    for op in ops:
        if not isinstance(op, StatementWrite):
            groups.append([op])
            continue
        key = (id(op.statement), op.rows)
        group = by_key.get(key)
        if group is None:
            group = by_key[key] = []
            groups.append(group)
        group.append(op)
    return groups
