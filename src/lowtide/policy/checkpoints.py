"""Which checkpoint an attempt resumes from, and what a resume that crashes at once means (pure).

Role: the decisions behind `LOWTIDE_RESUME_FROM` (docs/architecture.md §6.2, §6.3). A step's
`LATEST` (or the API) names checkpoints; the store keeps every one it reported. Before a launch
the loop observes the candidates through the artifact port (`control.checkpoint_check`) and these
functions decide:

- `resume_candidates`: the labels to try, newest report first, each once, at most
  `MAX_CANDIDATES` (older ones are not looked at: the attempt starts over after that).
- `checkpoint_problem`: why an observed checkpoint cannot be resumed from, or None. It must exist;
  where the step wrote a manifest (`<label>.manifest.json`, the format in `control.contract`)
  every file it lists must exist with the listed size, and with the listed sha256 where lowtide
  hashed it (`HASH_BUDGET_BYTES`: files beyond the budget are checked by size only); a
  checkpoint marked bad because an attempt crashed on resuming from it (`BadCheckpoint`, same
  fingerprint) is skipped. A port that cannot see checkpoints (the simulator's) makes every
  checkpoint count as valid.
- `next_to_observe` / `choose_resume`: observe newest first until one is valid; resume from it,
  or from scratch when none is; each skipped one is reported with its problem (an event).
- `resume_crash`: an attempt that resumed from checkpoint C and failed on its own (non-zero exit,
  no notice, not the machinery's fault, not its walltime) within `window_s` of its start without
  reporting any new checkpoint crashed on C. C is marked bad and the step retried at once
  from the previous valid checkpoint without using a retry: the first time for each bad
  checkpoint, and at most as many times per step as it has known checkpoints (then the step's
  ordinary retries apply; once every checkpoint is bad the step starts over).

Neighbours: `control.checkpoint_check` observes and records; `control.loop` calls it at launch
and at exit; `policy.outcomes` makes the ordinary exit decision this one may replace.
Must not: read the clock, do I/O or touch the store.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from lowtide.domain.states import AttemptState, StepState
from lowtide.policy.outcomes import ExitDecision

#: How many of a step's most recent checkpoints are looked at before an attempt starts over.
MAX_CANDIDATES = 16
#: Bytes of a checkpoint's files lowtide hashes to check a manifest's sha256 values (per
#: checkpoint, in manifest order); files past the budget are checked by size only.
HASH_BUDGET_BYTES = 64 * 1024 * 1024
#: The default of `executor.resume_crash_window` (seconds).
RESUME_CRASH_WINDOW_S = 120.0


@dataclass(frozen=True, slots=True)
class ManifestEntry:
    """One file a checkpoint's manifest lists: a path relative to the checkpoint directory."""

    path: str
    size: int
    sha256: str | None = None


@dataclass(frozen=True, slots=True)
class FileSeen:
    """What the artifact port saw of one manifest entry: its size (None: missing) and, when it
    was hashed within the budget, its sha256; `problem` when it could not be looked at safely
    (a symbolic link, not a regular file)."""

    entry: ManifestEntry
    size: int | None
    sha256: str | None = None
    problem: str | None = None


@dataclass(frozen=True, slots=True)
class CheckpointSeen:
    """What the artifact port saw of a checkpoint before a launch.

    `visible` False: the port cannot see checkpoints at all (nothing to check). `exists`: the
    label names something. `manifest`: "none" (the step wrote none), "ok" (parsed; `files` holds
    what was seen of each entry) or "bad" (`manifest_error` says why). `fingerprint` identifies
    this version of the checkpoint (sizes and modification times, or the manifest's digest): a
    checkpoint rewritten under the same label after it was marked bad is not bad.
    """

    label: str
    visible: bool = True
    exists: bool = True
    problem: str | None = None
    manifest: str = "none"
    manifest_error: str | None = None
    files: tuple[FileSeen, ...] = ()
    fingerprint: str | None = None


@dataclass(frozen=True, slots=True)
class BadCheckpoint:
    """A checkpoint an attempt crashed on resuming from (recorded with that attempt)."""

    label: str
    fingerprint: str | None
    attempt_id: int


@dataclass(frozen=True, slots=True)
class ResumeChoice:
    """Where the next attempt resumes (None: from scratch), and the checkpoints skipped."""

    label: str | None
    fingerprint: str | None = None
    skipped: tuple[tuple[str, str], ...] = ()  # (label, problem), newest first

    def messages(self) -> tuple[tuple[str, str], ...]:
        """(label, event text) for each skipped checkpoint."""
        then = f"resuming from {self.label}" if self.label is not None else "starting over"
        return tuple(
            (label, f"checkpoint {label} invalid: {problem}; {then}") for label, problem in self.skipped
        )


def resume_candidates(labels_in_report_order: Iterable[str], latest: str | None) -> tuple[str, ...]:
    """The labels to try: the step's latest first, then the others newest report first, once each."""
    ordered = list(labels_in_report_order)
    if latest is not None:
        ordered.append(latest)
    seen: dict[str, None] = {}
    for label in reversed(ordered):
        seen.setdefault(label, None)
        if len(seen) >= MAX_CANDIDATES:
            break
    return tuple(seen)


def is_bad(seen: CheckpointSeen, bad: Sequence[BadCheckpoint]) -> bool:
    """Marked bad by a resume crash: same label and, where both are known, same fingerprint."""
    return any(
        b.label == seen.label
        and (b.fingerprint is None or seen.fingerprint is None or b.fingerprint == seen.fingerprint)
        for b in bad
    )


def checkpoint_problem(seen: CheckpointSeen, bad: Sequence[BadCheckpoint] = ()) -> str | None:
    """Why the attempt cannot resume from this checkpoint (None: it can)."""
    if is_bad(seen, bad):
        return "an attempt crashed right after resuming from it"
    if not seen.visible:
        return None
    if not seen.exists:
        return "it does not exist"
    if seen.problem is not None:
        return seen.problem
    if seen.manifest == "bad":
        return f"its manifest is unusable: {seen.manifest_error}"
    for f in seen.files:
        name = f.entry.path
        if f.problem is not None:
            return f"{name}: {f.problem}"
        if f.size is None:
            return f"{name} listed in its manifest is missing"
        if f.size != f.entry.size:
            return f"{name} is {f.size} bytes, its manifest says {f.entry.size}"
        if f.sha256 is not None and f.entry.sha256 is not None and f.sha256 != f.entry.sha256.lower():
            return f"{name} does not match the sha256 in its manifest"
    return None


def next_to_observe(
    candidates: Sequence[str], seen: Mapping[str, CheckpointSeen], bad: Sequence[BadCheckpoint]
) -> str | None:
    """The next candidate to observe (None: a valid one was found, or none is left)."""
    for label in candidates:
        s = seen.get(label)
        if s is None:
            return label
        if checkpoint_problem(s, bad) is None:
            return None
    return None


def choose_resume(
    candidates: Sequence[str], seen: Mapping[str, CheckpointSeen], bad: Sequence[BadCheckpoint]
) -> ResumeChoice:
    """The newest observed valid candidate; those before it are skipped with their problem."""
    skipped: list[tuple[str, str]] = []
    for label in candidates:
        s = seen.get(label)
        if s is None:
            break
        problem = checkpoint_problem(s, bad)
        if problem is None:
            return ResumeChoice(label, s.fingerprint, tuple(skipped))
        skipped.append((label, problem))
    return ResumeChoice(None, None, tuple(skipped))


# -- a resume that crashes at once ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ResumeCrashFacts:
    """What `resume_crash` needs about an attempt that ended and its step."""

    step_state: StepState
    noticed: bool
    exit_code: int | None
    signal: int | None
    killed_at_deadline: bool
    infrastructure: bool
    timed_out: bool
    resumed_from: str | None
    resume_fingerprint: str | None
    started_at: float
    ended_at: float
    checkpointed_during: bool
    #: Checkpoints marked bad on the step's earlier attempts (not this one).
    earlier_bad: tuple[BadCheckpoint, ...]
    #: How many distinct checkpoints of the step are known.
    known_checkpoints: int
    retries_used: int


def resume_crash(facts: ResumeCrashFacts, *, window_s: float, now: float) -> ExitDecision | None:
    """The decision for an attempt that crashed right after resuming (see the module docstring),
    or None when the ordinary exit decision stands."""
    f = facts
    if (
        f.resumed_from is None
        or f.step_state != StepState.RUNNING
        or f.noticed
        or f.killed_at_deadline
        or f.infrastructure
        or f.timed_out
        or f.exit_code == 0
        or f.checkpointed_during
        or f.ended_at - f.started_at > window_s
    ):
        return None
    seen = CheckpointSeen(label=f.resumed_from, fingerprint=f.resume_fingerprint)
    if is_bad(seen, f.earlier_bad) or len(f.earlier_bad) >= max(1, f.known_checkpoints):
        return None  # not the first time for this checkpoint, or the step's fallbacks are spent
    how = f"exit code {f.exit_code}" if f.exit_code is not None else f"signal {f.signal}"
    return ExitDecision(
        AttemptState.FAILED,
        StepState.READY,
        f.retries_used,
        now,
        f"failed ({how}) {f.ended_at - f.started_at:.0f}s after resuming from checkpoint {f.resumed_from}, "
        "before any new checkpoint: checkpoint marked bad; retrying from the one before it "
        "without using a retry",
        requeued=True,
    )
