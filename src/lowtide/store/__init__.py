"""Persistence: SQLAlchemy Core tables, Alembic migrations, guarded state transitions.

SQLite (WAL) by default, PostgreSQL in production; the same code and tests run on both.
"""
