"""Persistence: SQLAlchemy Core tables, Alembic migrations, guarded state transitions.

SQLite (WAL) by default, PostgreSQL in production; the same code and tests run on both.
`store.memory.MemoryStore` keeps the same data in Python objects behind the same methods (the
simulator runs on it); both apply every rule through the same pure functions in `policy`, and the
store tests run on all three backends. Must not: import anything here (the simulator imports
`store.memory`, which must stay free of SQLAlchemy).
"""
