"""Checkpoints verified before resume (issue 12): the pure choice of where an attempt resumes,
the resume-crash fallback, the manifest format, what the observer sees through the artifact port
(in memory and on a real local directory, links not followed)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

from lowtide.adapters.storage import FsspecArtifacts
from lowtide.config import ConfigError, load_settings
from lowtide.control.checkpoint_check import choose_for_launch, observe
from lowtide.control.contract import manifest_uri, parse_manifest
from lowtide.control.executor_port import ExecutorError
from lowtide.control.ports import PathStat
from lowtide.control.records import AttemptLaunch, AttemptRecord, CheckpointRecord
from lowtide.domain.spec import ResolvedStep
from lowtide.domain.states import AttemptState, StepState
from lowtide.policy.checkpoints import (
    MAX_CANDIDATES,
    BadCheckpoint,
    CheckpointSeen,
    FileSeen,
    ManifestEntry,
    ResumeCrashFacts,
    checkpoint_problem,
    choose_resume,
    next_to_observe,
    resume_candidates,
    resume_crash,
)
from lowtide.sim.scripted import MemoryArtifacts

DIR = "/art/jobs/j/t/checkpoints"


def manifest(*files: tuple[str, bytes], sha: bool = True) -> str:
    return json.dumps(
        {
            "format": "lowtide-checkpoint-manifest/1",
            "files": [
                {"path": p, "size": len(d), **({"sha256": hashlib.sha256(d).hexdigest()} if sha else {})}
                for p, d in files
            ],
        }
    )


# -- candidates and the choice -----------------------------------------------------------------


def test_candidates_are_newest_first_once_each_and_bounded() -> None:
    assert resume_candidates(["c1", "c2", "c1", "c3"], "c3") == ("c3", "c1", "c2")
    assert resume_candidates([], None) == ()
    many = [f"c{i}" for i in range(100)]
    assert resume_candidates(many, "c99") == tuple(f"c{i}" for i in range(99, 99 - MAX_CANDIDATES, -1))


def test_the_newest_valid_checkpoint_is_chosen_and_the_ones_skipped_say_why() -> None:
    candidates = ("c3", "c2", "c1")
    seen: dict[str, CheckpointSeen] = {}
    assert next_to_observe(candidates, seen, ()) == "c3"
    seen["c3"] = CheckpointSeen("c3", exists=False)
    assert next_to_observe(candidates, seen, ()) == "c2"
    entry = ManifestEntry("c2/model.pt", 100, "ab" * 32)
    seen["c2"] = CheckpointSeen("c2", manifest="ok", files=(FileSeen(entry, 60),), fingerprint="f2")
    assert next_to_observe(candidates, seen, ()) == "c1"
    seen["c1"] = CheckpointSeen("c1", fingerprint="f1")
    assert next_to_observe(candidates, seen, ()) is None  # c1 is valid: nothing more to look at
    choice = choose_resume(candidates, seen, ())
    assert (choice.label, choice.fingerprint) == ("c1", "f1")
    assert choice.messages() == (
        ("c3", "checkpoint c3 invalid: it does not exist; resuming from c1"),
        ("c2", "checkpoint c2 invalid: c2/model.pt is 60 bytes, its manifest says 100; resuming from c1"),
    )


def test_no_valid_checkpoint_means_starting_over() -> None:
    seen = {"c1": CheckpointSeen("c1", manifest="bad", manifest_error="not JSON")}
    choice = choose_resume(("c1",), seen, ())
    assert choice.label is None
    assert choice.messages() == (
        ("c1", "checkpoint c1 invalid: its manifest is unusable: not JSON; starting over"),
    )


@pytest.mark.parametrize(
    ("seen", "problem"),
    [
        (CheckpointSeen("c", visible=False), None),  # a port that cannot see files: trusted
        (CheckpointSeen("c"), None),  # exists, no manifest
        (CheckpointSeen("c", exists=False), "it does not exist"),
        (CheckpointSeen("c", problem="it is a link"), "it is a link"),
        (
            CheckpointSeen("c", manifest="ok", files=(FileSeen(ManifestEntry("a", 3), None),)),
            "a listed in its manifest is missing",
        ),
        (
            CheckpointSeen(
                "c", manifest="ok", files=(FileSeen(ManifestEntry("a", 3, "0" * 64), 3, "1" * 64),)
            ),
            "a does not match the sha256 in its manifest",
        ),
        (  # over the hash budget: checked by size only
            CheckpointSeen("c", manifest="ok", files=(FileSeen(ManifestEntry("a", 3, "0" * 64), 3, None),)),
            None,
        ),
    ],
)
def test_what_makes_a_checkpoint_invalid(seen: CheckpointSeen, problem: str | None) -> None:
    assert checkpoint_problem(seen) == problem


def test_a_checkpoint_marked_bad_is_skipped_unless_it_was_rewritten() -> None:
    bad = (BadCheckpoint("c2", "old", attempt_id=7),)
    crashed = "an attempt crashed right after resuming from it"
    assert checkpoint_problem(CheckpointSeen("c2", fingerprint="old"), bad) == crashed
    assert checkpoint_problem(CheckpointSeen("c2", fingerprint="new"), bad) is None
    assert checkpoint_problem(CheckpointSeen("c2", visible=False), bad) == crashed  # unknown: by label
    assert checkpoint_problem(CheckpointSeen("c1", fingerprint="old"), bad) is None


# -- the resume-crash fallback -----------------------------------------------------------------


def facts(**overrides: object) -> ResumeCrashFacts:
    base: dict[str, object] = {
        "step_state": StepState.RUNNING,
        "noticed": False,
        "exit_code": 1,
        "signal": None,
        "killed_at_deadline": False,
        "infrastructure": False,
        "timed_out": False,
        "resumed_from": "c2",
        "resume_fingerprint": "f2",
        "started_at": 1000.0,
        "ended_at": 1030.0,
        "checkpointed_during": False,
        "earlier_bad": (),
        "known_checkpoints": 2,
        "retries_used": 1,
    }
    return ResumeCrashFacts(**{**base, **overrides})  # type: ignore[arg-type]


def test_a_resume_that_crashes_at_once_is_retried_without_using_a_retry() -> None:
    decision = resume_crash(facts(), window_s=120, now=1030.0)
    assert decision is not None
    assert (decision.attempt_state, decision.step_state) == (AttemptState.FAILED, StepState.READY)
    assert (decision.retries_used, decision.eligible_at, decision.requeued) == (1, 1030.0, True)
    assert "30s after resuming from checkpoint c2" in decision.message


@pytest.mark.parametrize(
    "overrides",
    [
        {"resumed_from": None},  # started from scratch: an ordinary failure
        {"exit_code": 0},
        {"noticed": True},
        {"step_state": StepState.CANCELLING},
        {"step_state": StepState.PREEMPTING},
        {"killed_at_deadline": True},
        {"infrastructure": True},
        {"timed_out": True},
        {"checkpointed_during": True},  # it got past the checkpoint
        {"ended_at": 1121.0},  # outside the window
        {"earlier_bad": (BadCheckpoint("c2", "f2", 3),)},  # not the first time for this checkpoint
        {"earlier_bad": (BadCheckpoint("c9", None, 3), BadCheckpoint("c8", None, 4))},  # fallbacks spent
    ],
)
def test_the_ordinary_decision_stands_otherwise(overrides: dict[str, object]) -> None:
    assert resume_crash(facts(**overrides), window_s=120, now=1100.0) is None


def test_a_window_of_zero_turns_the_fallback_off() -> None:
    assert resume_crash(facts(ended_at=1000.5), window_s=0, now=1000.5) is None


# -- the manifest format -----------------------------------------------------------------------


def test_a_manifest_lists_files_with_sizes_and_optional_hashes() -> None:
    text = json.dumps(
        {
            "format": "lowtide-checkpoint-manifest/1",
            "files": [
                {"path": "c1/model.pt", "size": 5, "sha256": "AB" * 32},
                {"path": "c1/opt.pt", "size": 0},
            ],
        }
    )
    assert parse_manifest(text) == (ManifestEntry("c1/model.pt", 5, "ab" * 32), ManifestEntry("c1/opt.pt", 0))
    assert manifest_uri(DIR, "c1") == f"{DIR}/c1.manifest.json"
    assert manifest_uri(DIR, "c1/") == f"{DIR}/c1.manifest.json"


@pytest.mark.parametrize(
    ("doc", "reason"),
    [
        ("{", "not JSON"),
        ({"files": []}, "format"),
        ({"format": "lowtide-checkpoint-manifest/1", "files": []}, "non-empty"),
        (
            {"format": "lowtide-checkpoint-manifest/1", "files": [{"path": "../x", "size": 1}]},
            "relative path",
        ),
        ({"format": "lowtide-checkpoint-manifest/1", "files": [{"path": "/x", "size": 1}]}, "relative path"),
        ({"format": "lowtide-checkpoint-manifest/1", "files": [{"path": "x", "size": -1}]}, "whole number"),
        ({"format": "lowtide-checkpoint-manifest/1", "files": [{"path": "x", "size": True}]}, "whole number"),
        (
            {"format": "lowtide-checkpoint-manifest/1", "files": [{"path": "x", "size": 1, "sha256": "z"}]},
            "64 hex",
        ),
    ],
)
def test_a_malformed_manifest_is_refused_with_the_reason(doc: object, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_manifest(doc if isinstance(doc, str) else json.dumps(doc))


# -- observing through the artifact port -------------------------------------------------------


def test_observing_in_memory_checks_existence_sizes_and_hashes() -> None:
    art = MemoryArtifacts(strict=True)
    assert checkpoint_problem(observe(art, DIR, "c1")) == "it does not exist"
    art.files[f"{DIR}/c1"] = "weights"
    assert checkpoint_problem(observe(art, DIR, "c1")) is None  # no manifest: existence only
    art.files[manifest_uri(DIR, "c1")] = manifest(("c1", b"weights"))
    assert checkpoint_problem(observe(art, DIR, "c1")) is None
    art.files[f"{DIR}/c1"] = "weighs"  # truncated
    assert checkpoint_problem(observe(art, DIR, "c1")) == "c1 is 6 bytes, its manifest says 7"
    art.files[f"{DIR}/c1"] = "WEIGHTS"  # same size, other bytes
    assert checkpoint_problem(observe(art, DIR, "c1")) == "c1 does not match the sha256 in its manifest"
    assert checkpoint_problem(observe(art, DIR, "c1", hash_budget=3)) is None  # over budget: size only
    art.files[manifest_uri(DIR, "c1")] = '{"format": "lowtide-checkpoint-manifest/1", "fil'  # cut short
    assert checkpoint_problem(observe(art, DIR, "c1")).startswith("its manifest is unusable: not JSON")  # type: ignore[union-attr]
    assert not observe(MemoryArtifacts(), DIR, "c9").visible  # not strict: nothing to see, trusted


def test_the_fingerprint_changes_when_a_checkpoint_is_rewritten() -> None:
    art = MemoryArtifacts(strict=True)
    art.files[f"{DIR}/c1"] = "v1"
    art.files[manifest_uri(DIR, "c1")] = manifest(("c1", b"v1"))
    first = observe(art, DIR, "c1").fingerprint
    art.files[manifest_uri(DIR, "c1")] = manifest(("c1", b"v2"))
    assert observe(art, DIR, "c1").fingerprint != first


def test_a_local_checkpoint_is_stat_and_hashed_without_following_links(tmp_path: Path) -> None:
    root = tmp_path / "art"
    ckpt = root / "jobs" / "j" / "t" / "checkpoints"
    ckpt.mkdir(parents=True)
    secret = tmp_path / "secret"
    secret.write_bytes(b"admin token")
    (ckpt / "c1").mkdir()
    (ckpt / "c1" / "model.pt").write_bytes(b"weights")
    (ckpt / "c1.manifest.json").write_text(manifest(("c1/model.pt", b"weights")))
    art = FsspecArtifacts(str(root))
    d = str(ckpt)
    seen = observe(art, d, "c1")
    assert (seen.manifest, checkpoint_problem(seen)) == ("ok", None)
    assert art.stat(f"{d}/nothing") is None
    # A link as the checkpoint, as a listed file, or on the way to one, is not followed.
    os.symlink(secret, ckpt / "c2")
    assert checkpoint_problem(observe(art, d, "c2")) == (
        "it is not a regular file or directory (links are not followed)"
    )
    os.symlink(secret, ckpt / "c1" / "opt.pt")
    (ckpt / "c1.manifest.json").write_text(
        manifest(("c1/model.pt", b"weights"), ("c1/opt.pt", b"admin token"))
    )
    assert (
        checkpoint_problem(observe(art, d, "c1")) == "c1/opt.pt: not a regular file (links are not followed)"
    )
    os.symlink(tmp_path, ckpt / "c3")
    assert art.stat(f"{d}/c3/secret") is not None and art.stat(f"{d}/c3/secret").kind == "other"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="symbolic link"):
        art.sha256(f"{d}/c3/secret", max_bytes=100)
    assert art.sha256(f"{d}/c1/model.pt", max_bytes=100) == hashlib.sha256(b"weights").hexdigest()
    assert art.sha256(f"{d}/c1/model.pt", max_bytes=3) is None


def test_the_resume_crash_window_is_a_validated_duration(tmp_path: Path) -> None:
    cfg = tmp_path / "lowtide.yaml"
    cfg.write_text("executor: {resume_crash_window: 2m}\n")
    assert load_settings(cfg).executor.resume_crash_window == 120.0
    cfg.write_text("executor: {resume_crash_window: 2d}\n")
    with pytest.raises(ConfigError, match=r"executor\.resume_crash_window"):
        load_settings(cfg)


class _Store:
    """The two reads `choose_for_launch` makes, and the write it records the choice with."""

    def __init__(self, labels: list[str]) -> None:
        self.labels = labels
        self.resumes: list[tuple[str | None, tuple[tuple[str, str], ...]]] = []

    def step_checkpoints(self, job_id: str, step: str) -> list[CheckpointRecord]:
        return [CheckpointRecord(1, job_id, step, label, None, "file", 1.0) for label in self.labels]

    def step_attempts(self, job_id: str, step: str) -> list[AttemptRecord]:
        return []

    def record_resume(self, attempt_id: int, **kw: Any) -> None:
        self.resumes.append((kw["resume_from"], tuple(kw["skipped"])))


class _BrokenStorage(MemoryArtifacts):
    def stat(self, uri: str) -> PathStat | None:
        raise PermissionError(13, "Permission denied")


def _launch(last: str) -> AttemptLaunch:
    resolved = ResolvedStep("t", ("x",), 0, None, {}, {}, f"{DIR}/../outputs", DIR)
    return AttemptLaunch(7, 2, "j", "t", "team", "n1", (), resolved, {}, "/w", last, 30.0)


def test_the_launch_resumes_from_the_newest_valid_checkpoint_and_records_why() -> None:
    store = _Store(["c1", "c2"])
    art = MemoryArtifacts(strict=True)
    art.files[f"{DIR}/c1"] = "weights"
    assert choose_for_launch(store, art, _launch("c2"), 5.0) == "c1"  # type: ignore[arg-type]
    assert store.resumes == [("c1", (("c2", "checkpoint c2 invalid: it does not exist; resuming from c1"),))]


def test_a_storage_failure_while_checking_is_an_infrastructure_launch_failure() -> None:
    with pytest.raises(ExecutorError) as err:
        choose_for_launch(_Store(["c1"]), _BrokenStorage(), _launch("c1"), 5.0)  # type: ignore[arg-type]
    assert err.value.temporary and err.value.infrastructure == "permissions"
    assert "cannot check checkpoint c1" in str(err.value)
