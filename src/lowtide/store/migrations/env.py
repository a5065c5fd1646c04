"""Alembic environment: runs migrations on the connection `store.db.migrate` hands over
(or on `sqlalchemy.url` when alembic is run from the command line)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import engine_from_config, pool

from lowtide.store.schema import metadata

config = context.config


def run() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = engine_from_config(
        config.get_section(config.config_ini_section, {}), prefix="sqlalchemy.", poolclass=pool.NullPool
    )
    with engine.connect() as conn:
        context.configure(connection=conn, target_metadata=metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()


run()
