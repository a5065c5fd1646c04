"""The store facade: every read and write the API and the control loop make, one transaction each.

`Store` is a facade over one engine, composed of mixins that each subclass `base.StoreBase` (the
engine, `open`/`close`, the `_read()`/`_write()` transaction helpers, `instance_id`):
`jobs_repo.JobsRepo` (the API side: submit, list, read, cancel), `pool_repo.PoolRepo` (the GPU pool
and accounting), `attempts_repo.AttemptsRepo` (the control loop's side; `control.loop` uses it
through `control.ports.StorePort`), `replicas_repo.ReplicasRepo` (inference replicas, service
events), `reports_repo.ReportsRepo` (usage reports), `tokens_repo.TokensRepo` (API tokens) and
`state_repo.StateRepo` (what the controllers remember across a restart), `lending_repo.LendingRepo`
(the lending envelope's history); `lease_repo.LeaseRepo` (the one active control plane's lease and
fencing token); `job_end_repo.JobEndRepo` (finished jobs the executor has not yet ended).
Callers import `Store` (and `hash_token`) from here and never from the parts.
Methods return records (`control.records`), never live rows. `store.memory.MemoryStore` has the
same public methods, signatures and errors over Python objects; the rules both apply are pure
functions in `policy` (`attempt_rules`, `job_rules`, `pool_rules`, `fairshare`).
Must not: hold queries (they live in the parts), decide anything (retries, DAG progress and
placement are policy) or read the clock (every time is passed in).
"""

from __future__ import annotations

from lowtide.store.attempts_repo import AttemptsRepo
from lowtide.store.job_end_repo import JobEndRepo
from lowtide.store.jobs_repo import JobsRepo
from lowtide.store.lease_repo import LeaseRepo
from lowtide.store.lending_repo import LendingRepo
from lowtide.store.pool_repo import PoolRepo
from lowtide.store.replicas_repo import ReplicasRepo
from lowtide.store.reports_repo import ReportsRepo
from lowtide.store.state_repo import StateRepo
from lowtide.store.tokens_repo import ROLES, TokensRepo, hash_token

__all__ = ["ROLES", "Store", "hash_token"]


class Store(
    JobsRepo,
    PoolRepo,
    AttemptsRepo,
    ReplicasRepo,
    ReportsRepo,
    TokensRepo,
    StateRepo,
    LendingRepo,
    LeaseRepo,
    JobEndRepo,
):
    """The whole store: every part over one engine (see the module docstring)."""
