"""Bearer-token authentication and RBAC authorization for the fake API server.

Reproduces (kubernetes commit 000f2605): plugin/pkg/auth/authorizer/rbac/rbac.go and
pkg/apis/rbac/v1/evaluation_helpers.go — a request is allowed when some rule of a role bound to
the user (or one of their groups) matches its verb, API group, resource and resource name;
`*` matches all; a rule resource "pods/log" matches only that subresource and "*/log" matches
any resource's log; a bare "pods" rule does NOT cover "pods/log" or "deployments/scale";
resourceNames restrict get/update/patch/delete of named objects (a list or create never has a
name, so it never matches a resourceNames rule). Roles bound by a RoleBinding apply in its
namespace only (a RoleBinding may reference a ClusterRole); cluster-scoped and all-namespace
requests need a ClusterRoleBinding. ServiceAccount subjects are the user
"system:serviceaccount:<ns>:<name>" with groups system:serviceaccounts,
system:serviceaccounts:<ns>; every authenticated user is in system:authenticated; members of
system:masters bypass RBAC. The 403 message is responsewriters/errors.go `forbiddenMessage`.
Not reproduced: aggregated ClusterRoles (aggregationRule), escalation checks when creating
roles, non-resource URL rules (any authenticated user may read /api, /apis, /version).
Neighbours: `server` asks `authenticate` and `authorize`; tests load rendered chart RBAC.
Must NOT: know about HTTP or storage.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

MASTERS = "system:masters"


@dataclass(frozen=True)
class Rule:
    api_groups: tuple[str, ...]
    resources: tuple[str, ...]
    verbs: tuple[str, ...]
    resource_names: tuple[str, ...] = ()

    @classmethod
    def of(cls, rule: dict[str, Any]) -> Rule:
        return cls(
            tuple(rule.get("apiGroups") or ()),
            tuple(rule.get("resources") or ()),
            tuple(rule.get("verbs") or ()),
            tuple(rule.get("resourceNames") or ()),
        )

    def allows(self, verb: str, group: str, resource: str, subresource: str, name: str) -> bool:
        if "*" not in self.verbs and verb not in self.verbs:
            return False
        if "*" not in self.api_groups and group not in self.api_groups:
            return False
        combined = f"{resource}/{subresource}" if subresource else resource
        resource_ok = False
        for r in self.resources:
            if r in ("*", combined) or (subresource and r == f"*/{subresource}"):
                resource_ok = True
                break
        if not resource_ok:
            return False
        return not self.resource_names or name in self.resource_names


@dataclass(frozen=True)
class Binding:
    namespace: str  # "" for a ClusterRoleBinding
    role_kind: str  # Role | ClusterRole
    role_name: str
    subjects: tuple[tuple[str, str], ...]  # (kind, name) with ServiceAccounts as User names


@dataclass
class Authorizer:
    """Tokens → users, users → groups, and the RBAC objects in force."""

    tokens: dict[str, str] = field(default_factory=dict)
    groups: dict[str, tuple[str, ...]] = field(default_factory=dict)
    enabled: bool = True
    roles: dict[tuple[str, str], tuple[Rule, ...]] = field(default_factory=dict)  # (ns, name)
    cluster_roles: dict[str, tuple[Rule, ...]] = field(default_factory=dict)
    bindings: list[Binding] = field(default_factory=list)

    def add_token(self, token: str, user: str, groups: Iterable[str] = ()) -> None:
        self.tokens[token] = user
        self.groups[user] = tuple(groups)

    def authenticate(self, token: str) -> str | None:
        return self.tokens.get(token)

    def groups_of(self, user: str) -> set[str]:
        found = {"system:authenticated", *self.groups.get(user, ())}
        if user.startswith("system:serviceaccount:"):
            ns = user.split(":")[2]
            found |= {"system:serviceaccounts", f"system:serviceaccounts:{ns}"}
        return found

    def load(self, manifests: Iterable[dict[str, Any]]) -> None:
        """Add Role/ClusterRole/RoleBinding/ClusterRoleBinding manifests (rendered YAML docs)."""
        for doc in manifests:
            if not isinstance(doc, dict):
                continue
            kind = doc.get("kind")
            meta = doc.get("metadata") or {}
            rules = tuple(Rule.of(r) for r in doc.get("rules") or [])
            if kind == "Role":
                self.roles[(meta.get("namespace") or "default", meta["name"])] = rules
            elif kind == "ClusterRole":
                self.cluster_roles[meta["name"]] = rules
            elif kind in ("RoleBinding", "ClusterRoleBinding"):
                subjects: list[tuple[str, str]] = []
                for s in doc.get("subjects") or []:
                    if s.get("kind") == "ServiceAccount":
                        ns = s.get("namespace") or meta.get("namespace") or "default"
                        subjects.append(("User", f"system:serviceaccount:{ns}:{s['name']}"))
                    else:
                        subjects.append((s.get("kind", "User"), s["name"]))
                ref = doc.get("roleRef") or {}
                self.bindings.append(
                    Binding(
                        (meta.get("namespace") or "default") if kind == "RoleBinding" else "",
                        ref.get("kind", "ClusterRole"),
                        ref.get("name", ""),
                        tuple(subjects),
                    )
                )

    def grant(self, user: str, rules: Iterable[dict[str, Any]], namespace: str = "") -> None:
        """Shortcut: a (Cluster)Role with `rules` bound to `user` (cluster-wide when no namespace)."""
        name = f"grant-{len(self.bindings)}"
        if namespace:
            self.load(
                [
                    {
                        "kind": "Role",
                        "metadata": {"name": name, "namespace": namespace},
                        "rules": list(rules),
                    },
                    {
                        "kind": "RoleBinding",
                        "metadata": {"name": name, "namespace": namespace},
                        "roleRef": {"kind": "Role", "name": name},
                        "subjects": [{"kind": "User", "name": user}],
                    },
                ]
            )
        else:
            self.load(
                [
                    {"kind": "ClusterRole", "metadata": {"name": name}, "rules": list(rules)},
                    {
                        "kind": "ClusterRoleBinding",
                        "metadata": {"name": name},
                        "roleRef": {"kind": "ClusterRole", "name": name},
                        "subjects": [{"kind": "User", "name": user}],
                    },
                ]
            )

    def _rules(self, binding: Binding) -> tuple[Rule, ...]:
        if binding.role_kind == "Role":
            return self.roles.get((binding.namespace, binding.role_name), ())
        return self.cluster_roles.get(binding.role_name, ())

    def authorize(
        self, user: str, verb: str, group: str, resource: str, subresource: str, namespace: str, name: str
    ) -> bool:
        if not self.enabled:
            return True
        groups = self.groups_of(user)
        if MASTERS in groups:
            return True
        for b in self.bindings:
            if b.namespace and b.namespace != namespace:
                continue
            if not any((k == "User" and n == user) or (k == "Group" and n in groups) for k, n in b.subjects):
                continue
            if any(r.allows(verb, group, resource, subresource, name) for r in self._rules(b)):
                return True
        return False


def forbidden_message(
    user: str, verb: str, group: str, resource: str, subresource: str, namespace: str
) -> str:
    combined = f"{resource}/{subresource}" if subresource else resource
    if namespace:
        return (
            f'User "{user}" cannot {verb} resource "{combined}" in API group "{group}" '
            f'in the namespace "{namespace}"'
        )
    return f'User "{user}" cannot {verb} resource "{combined}" in API group "{group}" at the cluster scope'
