"""An in-memory store: every public method of `store.repo.Store`, over Python objects.

`MemoryStore` has the SQL store's signatures, records (`control.records`) and error semantics:
guarded transitions check the domain's lifecycle tables (`IllegalTransition`) and raise
`StaleState` when a row is not in the expected state, `GpuBusy` on double booking, `NotFound` for
missing ids; a call that raises has changed nothing. It keeps the same GPU ledger invariant (one
open interval per managed GPU, so GPU-seconds add up to capacity × time) and applies every rule
through the same `policy` functions as the SQL store (`attempt_rules`, `job_rules`,
`pool_rules`, `fairshare`). The loop's per-tick reads (`snapshot`, `active_attempts`,
`notices_due`, `job_views()`, `replicas`, `reclaims(state=OPEN)`) come from indexes and cost
what they return. Records are immutable values: JSON documents are shared read-only
(`values.FrozenDict`/`FrozenList`), never the store's rows. Each call holds one lock.
Open one with `MemoryStore()` or `MemoryStore.open("memory://")`; `close()` does nothing; the
data lives as long as the object.

Parts (each a mixin over `base.MemoryBase`, which holds the state and the guarded moves):
`jobs` (the API side), `attempts` (the loop's side), `pool` (GPUs, counts, usage reports),
`inference` (replicas, service events, reclaims, values), `tokens`, `state` (`control_state`), `lending`
(the lending envelope's history), `lease` (the control plane's lease and fence) and `job_end`
(finished jobs the executor has not yet ended).
Ids (jobs aside) count from 1 in creation order, as on SQLite; PostgreSQL's sequences may skip.
Neighbours: the simulator (`lowtide.sim`) and the tests run the control loop on it.
Must not: import SQLAlchemy (the simulator's import contract forbids it), do I/O, read the clock
(every time is passed in), or decide anything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lowtide.store.memory.attempts import AttemptsPart
from lowtide.store.memory.base import URL_SCHEME
from lowtide.store.memory.inference import InferencePart
from lowtide.store.memory.job_end import JobEndPart
from lowtide.store.memory.jobs import JobsPart
from lowtide.store.memory.lease import LeasePart
from lowtide.store.memory.lending import LendingPart
from lowtide.store.memory.pool import PoolPart
from lowtide.store.memory.state import StatePart
from lowtide.store.memory.tokens import TokensPart

__all__ = ["URL_SCHEME", "MemoryStore"]


class MemoryStore(
    JobsPart, PoolPart, AttemptsPart, InferencePart, TokensPart, StatePart, LendingPart, LeasePart, JobEndPart
):
    """The whole in-memory store: every part over one `base.MemoryBase` (see the module docstring)."""


if TYPE_CHECKING:  # the loop's and the inference side's ports, checked by mypy
    from lowtide.control.inference import InferenceStore
    from lowtide.control.ports import StorePort

    _loop_port: StorePort = MemoryStore()
    _inference_port: InferenceStore = MemoryStore()
