"""Schema migrations with Alembic, configured in code so no alembic.ini is needed.

The coordinator upgrades its database to the newest revision at start; a database
written by a newer fedra is refused rather than guessed at.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Engine

_SCRIPTS = Path(__file__).with_name("migrations")


class SchemaTooNew(RuntimeError):
    """The database was written by a newer fedra: its schema is not guessed at."""


def alembic_config(engine: Engine) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(_SCRIPTS))
    cfg.attributes["engine"] = engine
    return cfg


def head_revision() -> str:
    head = ScriptDirectory(str(_SCRIPTS)).get_current_head()
    assert head is not None
    return head


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine) -> None:
    """Bring the schema to the newest revision this fedra knows."""
    known = {s.revision for s in ScriptDirectory(str(_SCRIPTS)).walk_revisions()}
    current = current_revision(engine)
    if current is not None and current not in known:
        raise SchemaTooNew(
            f"database schema revision {current!r} is newer than this fedra understands; "
            "upgrade fedra"
        )
    if current != head_revision():
        command.upgrade(alembic_config(engine), "head")
