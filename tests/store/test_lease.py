"""The control plane's lease in the store (docs/architecture.md §4.4), on SQLite, PostgreSQL and
memory: acquire, renew, expiry, takeover, the fencing token, a stale leader's writes refused.

Two control planes are two store objects on one database (the in-memory store: one object, whose
fence is the last one set). Expiry on PostgreSQL is judged by the server's clock, so the tests
wait out a short ttl for real there; elsewhere they pass a later `now`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from storekit import NODES, advance_dag, start, submit

from conftest import open_store
from lowtide.control.clock import FakeClock
from lowtide.control.lease import Fence, LeaseCandidate, LeaseClaim, holder_name, seat_of
from lowtide.control.records import FencedOut
from lowtide.store.memory import URL_SCHEME
from lowtide.store.repo import Store

TTL = 0.5


def candidate(seat: str, pid: int, nonce: str = "a1", host: str = "host-a") -> LeaseCandidate:
    full_seat = seat_of(host, seat)
    return LeaseCandidate(holder_name(full_seat, pid, nonce), full_seat, host, pid)


A = candidate("seat-a", 100)
B = candidate("seat-b", 200)


@pytest.fixture
def pair(store_url: str) -> Iterator[tuple[Store, Store]]:
    """Two control planes' stores on one database (memory: one object)."""
    a = open_store(store_url)
    b = a if store_url.startswith(URL_SCHEME) else open_store(store_url)
    yield a, b
    a.close()
    if b is not a:
        b.close()


def backend(store: Store) -> str:
    engine = getattr(store, "engine", None)
    return "memory" if engine is None else str(engine.dialect.name)


def is_pg(store: Store) -> bool:
    return backend(store) == "postgresql"


def leader_died(a: Store, b: Store) -> None:
    """The first control plane is gone: on SQLite its lock file is released with its process."""
    if backend(a) == "sqlite" and a is not b:
        a.close()


def after_expiry(store: Store, now: float) -> float:
    """A `now` past a lease claimed at `now` (PostgreSQL: wait it out on the server's clock)."""
    if is_pg(store):
        time.sleep(TTL + 0.15)
    return now + TTL + 10


def claim(store: Store, who: LeaseCandidate, now: float) -> LeaseClaim:
    return store.claim_lease(who, ttl_s=TTL, now=now)


def test_the_first_claim_gets_token_1_and_a_renew_keeps_it(pair: tuple[Store, Store]) -> None:
    a, _ = pair
    now = time.time()
    first = claim(a, A, now)
    assert first.granted and first.previous is None
    assert first.lease is not None and first.lease.token == 1 and first.lease.holder == A.holder
    assert first.lease.expires_at > first.at
    renewed = claim(a, A, now + 0.1)
    assert renewed.granted and renewed.lease is not None
    assert renewed.lease.token == 1 and renewed.lease.acquired_at == first.lease.acquired_at
    assert renewed.lease.expires_at >= first.lease.expires_at
    row, at = a.lease(now=now + 0.1)
    assert row == renewed.lease and at >= first.at


def test_another_control_plane_is_refused_until_the_lease_expires_then_takes_over_with_a_new_token(
    pair: tuple[Store, Store],
) -> None:
    a, b = pair
    now = time.time()
    assert claim(a, A, now).granted
    leader_died(a, b)
    refused = claim(b, B, now + 0.1)
    assert not refused.granted and refused.lease is not None and refused.lease.holder == A.holder
    later = after_expiry(b, now)
    taken = claim(b, B, later)
    assert taken.granted and taken.lease is not None
    assert taken.lease.token == 2 and taken.lease.holder == B.holder and taken.lease.host == B.host
    assert taken.previous is not None and taken.previous.holder == A.holder and taken.previous.token == 1


def test_a_released_lease_is_taken_over_at_once(pair: tuple[Store, Store]) -> None:
    a, b = pair
    now = time.time()
    assert claim(a, A, now).granted
    assert not a.release_lease(B.holder, now=now)  # only the holder releases
    assert a.release_lease(A.holder, now=now)
    taken = claim(b, B, now + 0.01)
    assert taken.granted and taken.lease is not None and taken.lease.token == 2


def test_a_restart_on_the_same_seat_takes_over_without_waiting(pair: tuple[Store, Store]) -> None:
    """A new process of the same state dir (it holds the state dir's lock, so the old one is gone)."""
    a, b = pair
    now = time.time()
    assert claim(a, A, now).granted
    leader_died(a, b)
    restarted = LeaseCandidate(holder_name(A.seat, 101, "b2"), A.seat, A.host, 101)
    taken = claim(b, restarted, now + 0.01)
    assert taken.granted and taken.lease is not None and taken.lease.token == 2
    assert taken.previous is not None and taken.previous.holder == A.holder


def test_a_stale_leaders_write_is_refused_and_rolled_back(
    pair: tuple[Store, Store], clock: FakeClock
) -> None:
    a, b = pair
    now = time.time()
    first = claim(a, A, now)
    assert first.lease is not None
    heard: list[FencedOut] = []
    a.fence_writes(Fence("control", first.lease.token), heard.append)
    a.ensure_gpus(NODES, clock.now())  # the leader's writes go through while it holds the lease
    job = submit(a, clock)
    advance_dag(a, job, clock.now())
    if backend(a) == "sqlite" and a is not b:
        a._drop_lease_lock()  # SQLite: as if its lock was lost (the process lives on, paused)
    assert claim(b, B, after_expiry(b, now)).granted  # token 2
    with pytest.raises(FencedOut, match="token 1"):
        start(a, job, "prep", clock.now())
    assert heard and isinstance(heard[0], FencedOut)
    assert b.active_attempts() == []  # nothing of the refused write is left
    # The new leader acts; the old one, once unfenced (a standby), writes plain records again.
    if b is not a:
        b.fence_writes(Fence("control", 2))
        launch = start(b, job, "prep", clock.now())
        assert [x.id for x in b.active_attempts()] == [launch.attempt_id]
        a.fence_writes(None)
        assert submit(a, clock, "job-000000000002") == "job-000000000002"


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
def test_on_sqlite_a_live_leader_keeps_the_lease_whatever_the_clocks_say(pair: tuple[Store, Store]) -> None:
    """The lock file next to the database: a live leader's lease cannot be taken, even past its
    expiry by the claimer's wall clock (a clock jump); once its process is gone it can."""
    a, b = pair
    now = time.time()
    assert claim(a, A, now).granted
    assert not claim(b, B, now + 3600).granted
    a.close()
    taken = claim(b, B, now + 3600)
    assert taken.granted and taken.lease is not None and taken.lease.token == 2


@pytest.mark.parametrize("store_url", ["postgresql"], indirect=True)
def test_on_postgresql_a_takeover_waits_for_the_leaders_write_in_flight(pair: tuple[Store, Store]) -> None:
    """The leader's write holds the lease row FOR SHARE: a takeover (FOR UPDATE) waits until that
    write committed, and every write that starts after the takeover is refused."""
    a, b = pair
    now = time.time()
    first = claim(a, A, now)
    assert first.lease is not None
    a.fence_writes(Fence("control", first.lease.token))
    later = after_expiry(b, now)
    done = threading.Event()
    taken: list[LeaseClaim] = []

    def take_over() -> None:
        taken.append(claim(b, B, later))
        done.set()

    with a._write() as conn:  # a write in flight, fenced: it holds the row FOR SHARE
        thread = threading.Thread(target=take_over, daemon=True)
        thread.start()
        assert not done.wait(0.5)  # the takeover waits for it
        conn.execute(sa.text("SELECT 1"))
    thread.join(timeout=10)
    assert taken and taken[0].granted and taken[0].lease is not None and taken[0].lease.token == 2
    with pytest.raises(FencedOut):
        a.ensure_gpus(NODES, now)
