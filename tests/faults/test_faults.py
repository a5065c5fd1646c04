"""The fault harness, reduced: one short chaos run per fault kind against real `lowtide up`
processes, every invariant of `faults.harness.INVARIANTS` asserted at zero violations.

The long form is `benchmarks/chaos.py` (the same harness, longer and with more faults). Each run
here has a fixed seed, so the faults chosen (which kind, which victim, when) are the same every
time; the timings are the machine's. What each test exercises is also asserted (faults were
injected), so a run that silently did nothing cannot pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa

from conftest import require_service
from faults.harness import PG_ADMIN_URL, Outcome, Plan, run_chaos

pytestmark = [pytest.mark.slow, pytest.mark.serial]


def assert_clean(outcome: Outcome) -> None:
    assert outcome.error is None, outcome.table()
    assert outcome.total_violations == 0, outcome.table()
    assert outcome.figures["jobs"] > 0 and outcome.figures["store_polls"] > 0, outcome.table()


def require_postgresql() -> None:
    engine = sa.create_engine(PG_ADMIN_URL)
    try:
        with engine.connect():
            pass
    except sa.exc.OperationalError as exc:
        require_service("postgresql", str(exc).splitlines()[0])
    finally:
        engine.dispose()


def test_kill_9_of_lowtide_gateway_shims_steps_and_replicas_during_surges_breaks_no_invariant(
    tmp_path: Path,
) -> None:
    outcome = run_chaos(
        Plan(seed=3, duration_s=8, jobs=4, kills=6, surges=True, train_steps=100, step_seconds=0.03),
        tmp_path,
    )
    assert_clean(outcome)
    # Every kind was tried once; lowtide itself is always there to kill.
    assert outcome.faults["kill_lowtide"] + outcome.faults["kill_lowtide_startup"] == 2, outcome.table()
    tried = {k.removeprefix("kill_") for k in (*outcome.faults, *outcome.skipped) if k.startswith("kill_")}
    assert tried == {"lowtide", "lowtide_startup", "gateway", "shim", "step", "replica"}, outcome.table()


def test_control_plane_restarts_under_load_fail_no_gateway_request(tmp_path: Path) -> None:
    outcome = run_chaos(
        Plan(
            seed=5, duration_s=5, jobs=2, kills=0, restarts=2, surges=False, steady_rate=4.0, train_steps=60
        ),
        tmp_path,
    )
    assert_clean(outcome)
    assert outcome.faults["restart_term"] == 1 and outcome.faults["restart_kill"] == 1, outcome.table()
    assert outcome.figures["steady_requests"]["sent"] > 0, outcome.table()


def test_an_unwritable_store_loses_no_exit_and_frees_the_gpus_once_it_recovers(tmp_path: Path) -> None:
    outcome = run_chaos(
        Plan(seed=7, duration_s=6, jobs=3, kills=0, store_outage_s=4, service=False),
        tmp_path,
    )
    assert_clean(outcome)
    assert outcome.faults["store_outage"] == 1, outcome.table()
    assert outcome.figures["exits_during_outage"] >= 1, outcome.table()


def test_clock_jumps_of_ten_minutes_move_no_deadline(tmp_path: Path) -> None:
    outcome = run_chaos(
        Plan(seed=11, duration_s=3, jobs=2, kills=0, clock_jump_s=600, service=False, train_steps=60),
        tmp_path,
    )
    assert_clean(outcome)
    assert outcome.faults["clock_jump"] == 2 and len(outcome.figures["deadline_shift_s"]) == 2, (
        outcome.table()
    )


def test_two_control_planes_on_one_postgresql_database_one_acts_and_the_standby_takes_over(
    tmp_path: Path,
) -> None:
    require_postgresql()
    outcome = run_chaos(
        Plan(
            seed=13,
            duration_s=10,
            jobs=3,
            kills=0,
            two_control_planes=True,
            store="postgresql",
            lease_ttl_s=3.0,
            lease_renew_s=1.0,
            surges=False,
            steady_rate=0,
            train_steps=60,
        ),
        tmp_path,
    )
    assert_clean(outcome)
    assert outcome.faults["kill_leader"] == 1, outcome.table()
    assert outcome.figures["standby_takeover_s"] is not None, outcome.table()
