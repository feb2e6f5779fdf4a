"""Alembic environment: runs migrations on the Engine handed over in the config."""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import Engine

from fedra.storage.models import Base

engine: Engine = context.config.attributes["engine"]
with engine.begin() as connection:
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    context.run_migrations()
