"""Secrets by reference: what the operator allows (`SecretRule`), the check of a spec's `secrets`
against it, and the port through which the loop reads values at launch (`SecretResolver`).

A spec names secrets (`domain.spec.SecretUse`); the operator defines them (config `secrets:`),
each with the environment variable it fills and the teams that may use it. The API checks a
spec with `secret_issues` at submit, validate and rerun; the loop asks the resolver for the
values of an attempt's secrets when it builds the launch request, and puts them only into
that request's environment (docs/architecture.md §11). Production: `adapters.secrets`.
Must not: hold, log or return a secret's value anywhere but `SecretResolver.environment`'s
result; read files or the environment (the adapter does); import the store or config.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from lowtide.domain.spec import JobSpec, SecretUse

#: A secret usable by every team.
ALL_TEAMS = "*"


@dataclass(frozen=True, slots=True)
class SecretRule:
    """What the operator allows for one secret: the variable it fills by default and the teams
    ("*": every team) whose jobs may name it."""

    env: str
    teams: tuple[str, ...]

    def allows(self, team: str) -> bool:
        return ALL_TEAMS in self.teams or team in self.teams


@dataclass(frozen=True, slots=True)
class SecretIssue:
    loc: str
    msg: str
    #: 403 when the secret exists but the job's team may not use it; 422 otherwise.
    status: int


class SecretResolver(Protocol):
    def environment(self, uses: Sequence[SecretUse]) -> dict[str, str]:
        """ENV_VAR -> value for these uses (a use without `env` fills its rule's variable).

        Raises `control.executor_port.ExecutorError` (temporary=False) naming the secret and the
        reason (an unknown secret, a missing file or variable), never its value: the attempt
        then fails to launch with that message."""
        ...


def secret_issues(spec: JobSpec, rules: Mapping[str, SecretRule]) -> list[SecretIssue]:
    """Every problem of the spec's secrets against the operator's `rules`, located as in the
    document: an unknown secret (422), a secret the job's team may not use (403), a variable
    that two secrets, or a secret and the step's `env`, would both set (422)."""
    out: list[SecretIssue] = []
    known = ", ".join(sorted(rules)) or "none are configured"

    def check(use: SecretUse, loc: str) -> str | None:
        rule = rules.get(use.name)
        if rule is None:
            out.append(SecretIssue(loc, f"unknown secret {use.name!r} (defined: {known})", 422))
            return None
        if not rule.allows(spec.team):
            teams = ", ".join(rule.teams)
            out.append(
                SecretIssue(
                    loc, f"team {spec.team!r} may not use secret {use.name!r} (allowed: {teams})", 403
                )
            )
            return None
        return use.env or rule.env

    job_envs: dict[str, str] = {}
    for j, use in enumerate(spec.secrets):
        if (env := check(use, f"secrets[{j}]")) is not None:
            job_envs[env] = f"secrets[{j}]"
    for i, step in enumerate(spec.steps):
        envs = dict(job_envs)
        for env, loc in job_envs.items():
            if env in step.env:
                out.append(SecretIssue(loc, f"{env} is also set by steps[{i}].env", 422))
        for j, use in enumerate(step.secrets):
            loc = f"steps[{i}].secrets[{j}]"
            if use in spec.secrets:
                continue  # the job gives it already
            env = check(use, loc)
            if env is None:
                continue
            if env in envs:
                out.append(SecretIssue(loc, f"{env} is also set by {envs[env]}", 422))
            elif env in step.env:
                out.append(SecretIssue(loc, f"{env} is also set by steps[{i}].env", 422))
            envs[env] = loc
    return out
