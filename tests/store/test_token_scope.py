"""Token scopes and job visibility in the store (docs/architecture.md §11), on every backend
(SQLite, PostgreSQL, memory); the 0005 migration on the SQL ones."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from alembic import command
from storekit import submit

from lowtide.control.clock import FakeClock
from lowtide.control.records import JobScope, LastAdminToken
from lowtide.store.db import alembic_config
from lowtide.store.repo import Store
from lowtide.store.schema import tokens


def test_tokens_keep_their_teams_and_highest_priority(store: Store, clock: FakeClock) -> None:
    user, raw = store.create_token(
        name="bob", owner="bob", role="user", now=clock.now(), teams=["vision", "speech"], max_priority=70
    )
    assert (user.teams, user.max_priority) == (("vision", "speech"), 70)
    who = store.authenticate(raw)
    assert who is not None and (who.teams, who.max_priority) == (("vision", "speech"), 70)
    default_user, _ = store.create_token(name="u", owner="u", role="user", now=clock.now())
    viewer, _ = store.create_token(name="v", owner="v", role="viewer", now=clock.now(), teams=["nlp"])
    admin, _ = store.create_token(name="a", owner="a", role="admin", now=clock.now(), teams=["nlp"])
    assert (default_user.teams, default_user.max_priority) == (("default",), 50)
    assert (viewer.teams, viewer.role) == (("nlp",), "viewer")
    assert (admin.teams, admin.max_priority) == (("*",), 100)  # an admin is never scoped
    assert [(t.name, t.teams, t.max_priority) for t in store.list_tokens()] == [
        ("bob", ("vision", "speech"), 70),
        ("u", ("default",), 50),
        ("v", ("nlp",), 0),
        ("a", ("*",), 100),
    ]
    with pytest.raises(ValueError, match="max_priority"):
        store.create_token(name="x", owner="x", role="user", now=clock.now(), max_priority=101)


def test_the_last_active_admin_token_is_never_revoked(store: Store, clock: FakeClock) -> None:
    first, _ = store.create_token(name="admin", owner="admin", role="admin", now=clock.now())
    user, _ = store.create_token(name="u", owner="u", role="user", now=clock.now())
    with pytest.raises(LastAdminToken, match="last active admin token"):
        store.revoke_token(first.id, clock.now())
    store.revoke_token(user.id, clock.now())  # other roles: as before
    second, _ = store.create_token(name="ops", owner="ops", role="admin", now=clock.now())
    store.revoke_token(first.id, clock.now())
    with pytest.raises(LastAdminToken):
        store.revoke_token(second.id, clock.now())
    assert store.has_admin_token()


def test_list_jobs_keeps_what_a_scope_may_see_before_the_limit(store: Store, clock: FakeClock) -> None:
    ids = {}
    for i, (owner, team) in enumerate(
        [("alice", "nlp"), ("bob", "vision"), ("carol", "nlp"), ("dan", "speech"), ("bob", "nlp")]
    ):
        ids[i] = submit(store, clock, f"job-{i:012d}", owner=owner, team=team)
        clock.advance(1)

    def listed(scope: JobScope | None, **kw: object) -> list[str]:
        return [j.id for j in store.list_jobs(visible_to=scope, **kw)]  # type: ignore[arg-type]

    bob = JobScope("bob", ("vision",))
    assert listed(bob) == [ids[4], ids[1]]  # his own (also in nlp) and his team's
    assert listed(bob, limit=1) == [ids[4]]
    assert listed(bob, limit=1, before=store.job(ids[4]).submitted_at) == [ids[1]]
    assert listed(JobScope("erin", ("nlp",))) == [ids[4], ids[2], ids[0]]
    assert listed(JobScope("erin", ("nlp", "speech")), limit=2, team="nlp") == [ids[4], ids[2]]
    assert listed(JobScope("erin", ())) == []
    assert listed(JobScope("erin", ("*",))) == listed(None) == [ids[i] for i in (4, 3, 2, 1, 0)]


def test_migration_0005_gives_earlier_tokens_every_team(sql_store: Store, clock: FakeClock) -> None:
    """Tokens minted before 0005 keep what they could do (every team, priority 100). SQL only."""
    record, raw = sql_store.create_token(name="old", owner="old", role="user", now=clock.now(), teams=["nlp"])
    cfg = alembic_config(sql_store.engine.url.render_as_string(hide_password=False))
    with sql_store.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0004")
        assert "teams" not in {c["name"] for c in sa.inspect(conn).get_columns("tokens")}
        command.upgrade(cfg, "head")
    who = sql_store.authenticate(raw)
    assert who is not None and who.id == record.id and (who.teams, who.max_priority) == (("*",), 100)
    with sql_store.engine.connect() as conn:
        assert conn.execute(sa.select(tokens.c.teams)).scalar_one() == ["*"]
