"""The database tables (SQLAlchemy Core). Alembic migrations under `migrations/` create exactly
these; a test compares the two so they cannot drift.

Times are float seconds since the epoch (UTC) on every backend: the policy code computes with
them directly. Must not: hold behaviour; queries live in `repo` modules.
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

Time = sa.Float(precision=53)

#: The predicate of the partial index `ix_jobs_executor_unended` (0009), repeated verbatim by the
#: query that must use it (`job_end_repo`).
UNENDED_PREDICATE = "executor_ended_at IS NULL"

jobs = sa.Table(
    "jobs",
    metadata,
    sa.Column("id", sa.String(40), primary_key=True),
    sa.Column("name", sa.String(63), nullable=False),
    sa.Column("team", sa.String(63), nullable=False),
    sa.Column("owner", sa.String(128), nullable=False),
    sa.Column("priority", sa.Integer, nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("submitted_at", Time, nullable=False),
    sa.Column("started_at", Time),
    sa.Column("finished_at", Time),
    sa.Column("cancel_requested_at", Time),
    sa.Column("grace_seconds", sa.Float, nullable=False),
    sa.Column("template", sa.String(63)),
    sa.Column("rerun_of", sa.String(40)),
    # The validated, template-expanded spec (JobSpec.to_document()): what `rerun` replays.
    sa.Column("spec", sa.JSON, nullable=False),
    # The submitted text, byte for byte as received (decoded UTF-8), for the record.
    sa.Column("source_text", sa.Text, nullable=False),
    sa.Column("message", sa.Text, nullable=False, server_default=""),
    # An `Idempotency-Key` the client sent with the submit (0006): a retry with the same owner and
    # key returns this job instead of creating another; `request_digest` (sha256 of the request)
    # tells a retry from a different request reusing the key.
    sa.Column("idempotency_key", sa.String(128)),
    sa.Column("request_digest", sa.String(64)),
    # When the executor took the job's end (`Executor.end_job`, 0009): NULL until the loop told it
    # of a job that will start nothing more (docs/cluster.md "When a job will start nothing more").
    sa.Column("executor_ended_at", Time),
    sa.Index(None, "state"),
    sa.Index(None, "team"),
    sa.Index(None, "submitted_at"),
    sa.Index(None, "owner", "idempotency_key", unique=True),
    # The jobs not yet ended by the executor (the live ones and a finished backlog), by state and
    # id: the loop's per-tick `jobs_to_end` reads only these rows (a partial index on both SQLite,
    # ≥ 3.8.0, and PostgreSQL; its predicate appears verbatim in the query, as SQLite requires).
    sa.Index(
        "ix_jobs_executor_unended",
        "state",
        "id",
        sqlite_where=sa.text(UNENDED_PREDICATE),
        postgresql_where=sa.text(UNENDED_PREDICATE),
    ),
)

steps = sa.Table(
    "steps",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("job_id", sa.String(40), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
    sa.Column("name", sa.String(63), nullable=False),
    sa.Column("idx", sa.Integer, nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("gpus", sa.Integer, nullable=False),
    sa.Column("depends", sa.JSON, nullable=False),
    # ResolvedStep as a document: command, image, env, inputs, outputs, checkpoint_dir.
    sa.Column("resolved", sa.JSON, nullable=False),
    sa.Column("max_retries", sa.Integer, nullable=False),
    sa.Column("retries_used", sa.Integer, nullable=False, server_default="0"),
    sa.Column("preemptions", sa.Integer, nullable=False, server_default="0"),
    sa.Column("eligible_at", Time, nullable=False, server_default="0"),
    sa.Column("reason", sa.Text, nullable=False, server_default=""),
    sa.Column("last_checkpoint", sa.Text),
    sa.Column("last_checkpoint_at", Time),
    # When `lowtide retry` last reopened it: its walltime counts attempts from then on.
    sa.Column("retried_at", Time),
    sa.Column("updated_at", Time, nullable=False),
    # Preemption: not before `min_runtime`; fail after `max_preemptions`; a restart costs this much.
    sa.Column("min_runtime", sa.Float, nullable=False, server_default="0"),
    sa.Column("max_preemptions", sa.Integer),
    sa.Column("restart_seconds", sa.Float, nullable=False, server_default="60"),
    # The grace of the stop in progress when it is shorter than the job's (a reclaim budget).
    sa.Column("stop_grace", sa.Float),
    sa.UniqueConstraint("job_id", "name"),
    sa.Index(None, "state"),
)

attempts = sa.Table(
    "attempts",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("job_id", sa.String(40), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
    sa.Column("step_id", sa.Integer, sa.ForeignKey("steps.id", ondelete="CASCADE"), nullable=False),
    sa.Column("step_name", sa.String(63), nullable=False),
    sa.Column("number", sa.Integer, nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("node", sa.String(63), nullable=False),
    sa.Column("gpus", sa.JSON, nullable=False),
    sa.Column("started_at", Time, nullable=False),
    sa.Column("ended_at", Time),
    # What runs it, as its executor names it (a pid, a pod): opaque; with when it was created.
    sa.Column("handle", sa.String(255)),
    sa.Column("handle_started_at", Time),
    # When it began to run (NULL while PENDING: an image pull, a pod waiting for its node).
    sa.Column("running_at", Time),
    sa.Column("exit_code", sa.Integer),
    sa.Column("signal", sa.Integer),
    sa.Column("notice_at", Time),
    sa.Column("stop_deadline", Time),
    sa.Column("stop_reason", sa.Text),
    sa.Column("killed_at_deadline", sa.Boolean, nullable=False, server_default=sa.false()),
    # Why it ended, as the executor saw it (domain.exit_reasons), and the executor's own words.
    sa.Column("exit_reason", sa.String(32)),
    sa.Column("exit_detail", sa.Text),
    sa.Column("work_dir", sa.Text, nullable=False),
    # GPU-seconds of work this attempt lost when it was stopped: from its last checkpoint (or its
    # start) to its end. Zero for attempts that finished; NULL while running.
    sa.Column("lost_gpu_seconds", sa.Float),
    # The exit decision said "preempted" (counted on the step's `preemptions`): what reports count.
    sa.Column("preempted", sa.Boolean, nullable=False, server_default=sa.false()),
    # Reproducibility record: resolved command, image, params, inputs and outputs of this attempt.
    sa.Column("record", sa.JSON, nullable=False),
    sa.Column("message", sa.Text, nullable=False, server_default=""),
    sa.UniqueConstraint("step_id", "number"),
    sa.Index(None, "state"),
    sa.Index(None, "job_id"),
)

checkpoints = sa.Table(
    "checkpoints",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("attempt_id", sa.Integer, sa.ForeignKey("attempts.id", ondelete="CASCADE"), nullable=False),
    sa.Column("job_id", sa.String(40), nullable=False),
    sa.Column("step_name", sa.String(63), nullable=False),
    sa.Column("label", sa.Text, nullable=False),
    sa.Column("progress", sa.Text),
    sa.Column("source", sa.String(8), nullable=False),  # "file" (LATEST) or "api"
    sa.Column("reported_at", Time, nullable=False),
    sa.Index(None, "job_id"),
)

events = sa.Table(
    "events",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("job_id", sa.String(40), nullable=False),
    sa.Column("step_name", sa.String(63)),
    sa.Column("attempt_id", sa.Integer),
    sa.Column("at", Time, nullable=False),
    sa.Column("kind", sa.String(32), nullable=False),
    sa.Column("message", sa.Text, nullable=False),
    sa.Index(None, "job_id"),
)

# Every interval in which a GPU is held, and by whom. Exactly one open row (ended_at NULL) per
# managed GPU at any time; holder_kind "idle" means nobody. The basis of all accounting.
gpu_ledger = sa.Table(
    "gpu_ledger",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("node", sa.String(63), nullable=False),
    sa.Column("gpu_index", sa.Integer, nullable=False),
    sa.Column("holder_kind", sa.String(16), nullable=False),  # idle | attempt | replica
    sa.Column("holder_id", sa.String(80)),
    sa.Column("job_id", sa.String(40)),
    sa.Column("team", sa.String(63)),
    sa.Column("started_at", Time, nullable=False),
    sa.Column("ended_at", Time),
    sa.Index(None, "node", "gpu_index", "ended_at"),
    sa.Index(None, "job_id"),
)

team_usage = sa.Table(
    "team_usage",
    metadata,
    sa.Column("team", sa.String(63), primary_key=True),
    # GPU-seconds of finished attempts, decayed to `as_of` (see policy.fairshare).
    sa.Column("decayed_gpu_seconds", sa.Float, nullable=False),
    sa.Column("as_of", Time, nullable=False),
)

tokens = sa.Table(
    "tokens",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("name", sa.String(128), nullable=False),
    sa.Column("owner", sa.String(128), nullable=False),
    sa.Column("role", sa.String(16), nullable=False),  # admin | user | viewer | step
    sa.Column("token_hash", sa.String(64), nullable=False, unique=True),
    sa.Column("attempt_id", sa.Integer),  # step tokens only: the attempt they may report for
    sa.Column("created_at", Time, nullable=False),
    sa.Column("revoked_at", Time),
    # Scope (docs/architecture.md §11): the teams the holder may submit for and see ("*": all),
    # and the highest priority it may submit. Tokens older than 0005 keep everything.
    sa.Column("teams", sa.JSON, nullable=False, server_default='["*"]'),
    sa.Column("max_priority", sa.Integer, nullable=False, server_default="100"),
)

meta = sa.Table(
    "meta",
    metadata,
    sa.Column("key", sa.String(64), primary_key=True),
    sa.Column("value", sa.Text, nullable=False),
)

# Inference replicas: one row per service slot that ever had a replica. GPUs are held in the
# ledger (holder_kind "replica") while the replica is in a GPU-holding state.
replicas = sa.Table(
    "replicas",
    metadata,
    sa.Column("id", sa.String(80), primary_key=True),  # "<service>/<slot>"
    sa.Column("service", sa.String(63), nullable=False),
    sa.Column("slot", sa.Integer, nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("node", sa.String(63)),
    sa.Column("gpus", sa.JSON, nullable=False),
    sa.Column("port", sa.Integer, nullable=False),
    sa.Column("parked_as", sa.String(8)),  # sleep | stop, while PARKED
    sa.Column("since", Time, nullable=False),
    sa.Column("failures", sa.Integer, nullable=False, server_default="0"),
    sa.Column("retry_at", Time, nullable=False, server_default="0"),
    sa.Column("message", sa.Text, nullable=False, server_default=""),
    sa.Index(None, "service"),
)

# What happened to services and replicas, with times: starts, health, drains, parks, failures,
# scale decisions. The inference side's counterpart of `events`.
service_events = sa.Table(
    "service_events",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("service", sa.String(63), nullable=False),
    sa.Column("replica_id", sa.String(80)),
    sa.Column("at", Time, nullable=False),
    sa.Column("kind", sa.String(32), nullable=False),
    sa.Column("message", sa.Text, nullable=False),
    sa.Index(None, "service", "at"),
)


# Every time inference takes GPUs back from research, with the phases the issue asks to see:
# surge detected → decision (victims) → notice → GPUs free → replica healthy.
reclaims = sa.Table(
    "reclaims",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("service", sa.String(63)),  # None: lending itself shrank (window close, fail safe)
    sa.Column("replica_id", sa.String(80)),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("gpus", sa.Integer, nullable=False),
    sa.Column("victims", sa.JSON, nullable=False),  # attempt ids
    sa.Column("state", sa.String(16), nullable=False),  # OPEN | DONE | ABANDONED
    sa.Column("detected_at", Time, nullable=False),
    sa.Column("decided_at", Time, nullable=False),
    sa.Column("notice_at", Time),
    sa.Column("freed_at", Time),
    sa.Column("healthy_at", Time),
    sa.Index(None, "state"),
)


# The control-plane lease (0006): who may act on this database. One row per lease name
# ("control"); `token` is the fencing token, raised by one at every change of holder, that the
# holder's writes carry and the store checks (docs/architecture.md §4.4).
control_lease = sa.Table(
    "control_lease",
    metadata,
    sa.Column("name", sa.String(63), primary_key=True),
    sa.Column("holder", sa.String(128), nullable=False),
    sa.Column("host", sa.String(255), nullable=False, server_default=""),
    sa.Column("pid", sa.Integer, nullable=False, server_default="0"),
    sa.Column("token", sa.BigInteger, nullable=False),
    sa.Column("acquired_at", Time, nullable=False),
    sa.Column("renewed_at", Time, nullable=False),
    sa.Column("expires_at", Time, nullable=False),
)

# What the control plane remembers across restarts beyond the rows above (0006): the autoscaler's
# windows and similar controller memory, one JSON document per key.
control_state = sa.Table(
    "control_state",
    metadata,
    sa.Column("key", sa.String(128), primary_key=True),
    sa.Column("value", sa.JSON, nullable=False),
    sa.Column("updated_at", Time, nullable=False),
)

# The lending envelope's history (0008): from `at` on, research could hold at most `lendable_gpus`
# GPUs under lending `mode`. The inference controller writes a row when the envelope changes and
# every few minutes otherwise, and deletes rows older than 48 h (`policy.lending_history`); the
# dashboard's timeline reads it to split idle GPUs into lent-and-idle and free.
lending_history = sa.Table(
    "lending_history",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("at", Time, nullable=False),
    sa.Column("lendable_gpus", sa.Integer, nullable=False),
    sa.Column("mode", sa.String(16), nullable=False),
    sa.Index(None, "at"),
)
