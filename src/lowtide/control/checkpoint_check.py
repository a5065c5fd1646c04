"""Checkpoints verified before resume: observe through the artifact port, decide in policy.

Role: at launch, `choose_for_launch` looks at the step's checkpoints newest first (its known
checkpoints from the store, each observed through `ArtifactPort.stat`/`read_text`/`sha256`: does
it exist, does its manifest match) until `policy.checkpoints` finds a valid one, and records the
choice with the attempt (`StorePort.record_resume`: the record's ``resume_from`` and one
``checkpoint_invalid`` event per checkpoint skipped). At exit, `resume_crash_decision` gathers what
`policy.checkpoints.resume_crash` needs and, when it says the attempt crashed on its checkpoint,
marks that checkpoint bad with the attempt (`StorePort.mark_checkpoint_bad`, before the exit is
recorded: a crash in between re-reads the exit and finds the mark its own) and returns the
decision that replaces the ordinary one. A storage error while looking (OSError) is a temporary
infrastructure launch failure (`ExecutorError`), never the step's. docs/architecture.md §6.2, §6.3.
Neighbours: `control.loop` (calls both), `control.contract` (the manifest format), the ports.
Must not: decide (policy does), read the clock, or touch files except through the artifact port.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from lowtide.control.contract import MANIFEST_MAX_BYTES, manifest_uri, parse_manifest, resume_uri
from lowtide.control.executor_port import AttemptExit, ExecutorError
from lowtide.control.ports import ArtifactPort, PathStat, StorePort
from lowtide.control.records import AttemptLaunch, AttemptRecord, ExitContext
from lowtide.domain.layout import join_uri
from lowtide.domain.states import AttemptState
from lowtide.policy import checkpoints as policy
from lowtide.policy.checkpoints import BadCheckpoint, CheckpointSeen, FileSeen, ResumeChoice
from lowtide.policy.outcomes import ExitDecision


def _stat_text(st: PathStat) -> str:
    return f"{st.kind}:{st.size}:{st.modified}"


def observe(
    artifacts: ArtifactPort, checkpoint_dir: str, label: str, *, hash_budget: int = policy.HASH_BUDGET_BYTES
) -> CheckpointSeen:
    """What the artifact port sees of checkpoint `label` (ValueError from the port is a problem
    of the checkpoint; OSError, a storage failure, propagates)."""
    uri = resume_uri(checkpoint_dir, label)
    st = artifacts.stat(uri)
    if st is None:
        return CheckpointSeen(label, exists=False)
    if st.kind == "unknown":
        return CheckpointSeen(label, visible=False)
    if st.kind == "other":
        return CheckpointSeen(label, problem="it is not a regular file or directory (links are not followed)")
    try:
        text = artifacts.read_text(manifest_uri(checkpoint_dir, label), max_bytes=MANIFEST_MAX_BYTES)
    except ValueError as exc:
        return CheckpointSeen(label, manifest="bad", manifest_error=str(exc), fingerprint=_stat_text(st))
    if text is None:
        return CheckpointSeen(label, fingerprint=_stat_text(st))
    fingerprint = "manifest:" + hashlib.sha256(text.encode()).hexdigest()
    try:
        entries = parse_manifest(text)
    except ValueError as exc:
        return CheckpointSeen(label, manifest="bad", manifest_error=str(exc), fingerprint=fingerprint)
    budget = hash_budget
    files: list[FileSeen] = []
    for entry in entries:
        file_uri = join_uri(checkpoint_dir, entry.path)
        fst = artifacts.stat(file_uri)
        if fst is None:
            files.append(FileSeen(entry, None))
            break  # one problem is enough to skip the checkpoint
        if fst.kind != "file":
            files.append(FileSeen(entry, fst.size, problem="not a regular file (links are not followed)"))
            break
        digest = None
        if (
            entry.sha256 is not None
            and fst.size == entry.size
            and fst.size is not None
            and fst.size <= budget
        ):
            try:
                digest = artifacts.sha256(file_uri, max_bytes=budget)
            except ValueError as exc:
                files.append(FileSeen(entry, fst.size, problem=str(exc)))
                break
            budget -= fst.size
        seen = FileSeen(entry, fst.size, digest)
        files.append(seen)
        if policy.checkpoint_problem(CheckpointSeen(label, manifest="ok", files=(seen,))) is not None:
            break
    return CheckpointSeen(label, manifest="ok", files=tuple(files), fingerprint=fingerprint)


def bad_marks(
    attempts: Sequence[AttemptRecord], *, excluding: int | None = None
) -> tuple[BadCheckpoint, ...]:
    """The checkpoints the step's attempts crashed on (their records' ``bad_checkpoint``)."""
    marks: list[BadCheckpoint] = []
    for att in attempts:
        mark = att.record.get("bad_checkpoint")
        if att.id != excluding and isinstance(mark, dict) and isinstance(mark.get("label"), str):
            fp = mark.get("fingerprint")
            marks.append(BadCheckpoint(mark["label"], fp if isinstance(fp, str) else None, att.id))
    return tuple(marks)


def choose_for_launch(
    store: StorePort, artifacts: ArtifactPort, launch: AttemptLaunch, now: float
) -> str | None:
    """The label the attempt resumes from (None: from scratch), recorded with the attempt."""
    ckpt_dir = launch.resolved.checkpoint_dir
    if ckpt_dir is None or launch.last_checkpoint is None:
        return None
    known = store.step_checkpoints(launch.job_id, launch.step)
    candidates = policy.resume_candidates((c.label for c in known), launch.last_checkpoint)
    bad = bad_marks(store.step_attempts(launch.job_id, launch.step))
    seen: dict[str, CheckpointSeen] = {}
    while (label := policy.next_to_observe(candidates, seen, bad)) is not None:
        try:
            seen[label] = observe(artifacts, ckpt_dir, label)
        except OSError as exc:  # lowtide's artifact storage failed, not the step (§6.3)
            kind = "permissions" if isinstance(exc, PermissionError) else "storage"
            raise ExecutorError(
                f"cannot check checkpoint {label}: {exc}", temporary=True, infrastructure=kind
            ) from exc
    choice: ResumeChoice = policy.choose_resume(candidates, seen, bad)
    if choice.label == launch.last_checkpoint and choice.fingerprint is None and not choice.skipped:
        return choice.label  # what `begin_attempt` recorded already (no files seen: the simulator)
    store.record_resume(
        launch.attempt_id,
        resume_from=choice.label,
        fingerprint=choice.fingerprint,
        skipped=choice.messages(),
        now=now,
    )
    return choice.label


def resume_crash_decision(
    store: StorePort,
    ctx: ExitContext,
    ex: AttemptExit,
    *,
    timed_out: bool,
    window_s: float,
) -> ExitDecision | None:
    """The decision replacing the ordinary one when the attempt crashed right after resuming
    (`policy.checkpoints.resume_crash`), with the checkpoint marked bad; else None."""
    noticed = ctx.attempt_state == AttemptState.STOPPING
    if ex.exit_code == 0 or noticed or ex.killed_at_deadline or ex.infrastructure is not None:
        return None  # cheap checks first: most exits read nothing more
    att = store.attempt(ctx.attempt_id)
    resumed_from = att.record.get("resume_from")
    if not isinstance(resumed_from, str) or ex.ended_at - att.started_at > window_s:
        return None
    known = store.step_checkpoints(ctx.job_id, ctx.step)
    fp = att.record.get("resume_fingerprint")
    facts = policy.ResumeCrashFacts(
        step_state=ctx.step_state,
        noticed=noticed,
        exit_code=ex.exit_code,
        signal=ex.signal,
        killed_at_deadline=ex.killed_at_deadline,
        infrastructure=ex.infrastructure is not None,
        timed_out=timed_out,
        resumed_from=resumed_from,
        resume_fingerprint=fp if isinstance(fp, str) else None,
        started_at=att.started_at,
        ended_at=ex.ended_at,
        checkpointed_during=any(c.attempt_id == att.id for c in known),
        earlier_bad=bad_marks(store.step_attempts(ctx.job_id, ctx.step), excluding=att.id),
        known_checkpoints=len({c.label for c in known}),
        retries_used=ctx.retries_used,
    )
    decision = policy.resume_crash(facts, window_s=window_s, now=ex.ended_at)
    if decision is not None:
        store.mark_checkpoint_bad(
            att.id,
            label=resumed_from,
            fingerprint=facts.resume_fingerprint,
            message=(
                f"checkpoint {resumed_from} marked bad: attempt {att.number} failed "
                f"{ex.ended_at - att.started_at:.0f}s after resuming from it, before any new checkpoint"
            ),
            now=ex.ended_at,
        )
    return decision
