"""Why an attempt ended, as its executor saw it: the exit code alone cannot say that a pod was
OOMKilled, evicted, deleted, never scheduled or could not pull its image.

Neighbours: executors set it on `control.executor_port.AttemptExit`; `policy.outcomes` maps each
reason to what happens to the step; the store keeps it with the attempt for the user.
Must not: decide anything (that is `policy.outcomes`).
"""

from __future__ import annotations

from enum import StrEnum


class ExitReason(StrEnum):
    """Why an attempt ended, as its executor saw it (the exit code alone cannot say).

    The loop maps each to an outcome in `policy.outcomes.classify_exit`."""

    EXITED = "EXITED"  # the step's process exited by itself (its code is `exit_code`)
    SIGNALLED = "SIGNALLED"  # killed by a signal nobody in lowtide sent
    DEADLINE = "DEADLINE"  # SIGKILLed by the executor when its grace deadline passed
    OOM_KILLED = "OOM_KILLED"  # the kernel (or the kubelet's cgroup) killed it for memory
    EVICTED = "EVICTED"  # the node evicted it (node pressure, drain): not the step's fault
    DELETED = "DELETED"  # its pod was deleted by someone other than lowtide
    UNSCHEDULABLE = "UNSCHEDULABLE"  # it never found its node: the machinery's fault
    IMAGE_PULL = "IMAGE_PULL"  # its image could not be pulled (a bad reference, a missing tag)
    INFRASTRUCTURE = "INFRASTRUCTURE"  # the machinery failed (`AttemptExit.infrastructure` says what)
