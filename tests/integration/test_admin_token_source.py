"""`auth.admin_token_source`: an admin token given from outside (a Kubernetes Secret mounted into
every control-plane pod) is registered once in the shared store instead of a new one minted at
every start, on SQLite, PostgreSQL and in memory."""

from __future__ import annotations

import secrets
import threading
from pathlib import Path

import pytest

from lowtide.control.clock import FakeClock
from lowtide.store.repo import Store
from lowtide.wiring import ServeError, ensure_admin_token, register_admin_token


def token_file(tmp_path: Path, text: str | None = None) -> Path:
    path = tmp_path / "secret" / "token"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text if text is not None else f"lt_{secrets.token_urlsafe(32)}\n")
    return path


def test_the_given_token_is_registered_once_and_none_is_minted(
    store: Store, clock: FakeClock, tmp_path: Path
) -> None:
    source = token_file(tmp_path)
    minted_at = tmp_path / "state" / "admin.token"
    for _ in range(3):  # three starts (or three pods) from the same Secret
        assert ensure_admin_token(store, minted_at, clock.now(), source) is None
    assert not minted_at.exists()
    record = store.authenticate(source.read_text().strip())
    assert record is not None and (record.role, record.name) == ("admin", "admin")
    assert [t.name for t in store.list_tokens() if t.role == "admin"] == ["admin"]


def test_two_control_planes_starting_at_once_keep_one_token(
    store: Store, clock: FakeClock, tmp_path: Path
) -> None:
    source = token_file(tmp_path)
    results: list[bool] = []
    errors: list[BaseException] = []

    def start() -> None:
        try:
            results.append(register_admin_token(store, source, clock.now()))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert errors == [] and results.count(True) <= 1
    assert len([t for t in store.list_tokens() if t.role == "admin"]) == 1


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "must hold one token"),
        ("lt_short", "must hold one token"),
        ("two tokens here", "must hold one token"),
    ],
)
def test_a_bad_token_file_is_refused_naming_the_setting(
    store: Store, clock: FakeClock, tmp_path: Path, text: str, says: str
) -> None:
    with pytest.raises(ServeError, match=rf"auth\.admin_token_source: .*{says}"):
        register_admin_token(store, token_file(tmp_path, text), clock.now())
    with pytest.raises(ServeError, match=r"auth\.admin_token_source: cannot read"):
        register_admin_token(store, tmp_path / "missing", clock.now())
    assert [t for t in store.list_tokens() if t.role == "admin"] == []
