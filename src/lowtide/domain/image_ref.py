"""Container image references: is `image` something a container runtime or a kubelet can pull?

Role: one pure check, `image_problem(text)`, used where a job spec is built (`spec_parse`), so a
reference no runtime could parse is refused at submission (HTTP 422 / exit 2 naming
`steps[i].image`) instead of failing each attempt later (cluster mode: the kubelet's
`InvalidImageName`; docker/podman: "invalid reference format").

The grammar is the distribution project's, which Docker, containerd, CRI-O and the kubelet use
(github.com/distribution/reference v0.6.0, `regexp.go` and `reference.go`):

    reference   := name [ ":" tag ] [ "@" digest ]
    name        := [ domain "/" ] path-component ( "/" path-component )*
    domain      := host [ ":" port ]       host: DNS name components joined by ".", or [IPv6]
    path-component := [a-z0-9]+ ( ( "." | "_" | "__" | "-"+ ) [a-z0-9]+ )*
    tag         := [A-Za-z0-9_][A-Za-z0-9_.-]{0,127}
    digest      := algorithm ":" hex{32,}

and a name is at most 255 characters (`NameTotalLengthMax`). As in `ParseNormalizedNamed`, the
first component is a registry only when it has a "." or ":" or is `localhost` (otherwise
`Ubuntu/x` would pass as a host): a repository path must be lowercase.
Must not: contact a registry, or decide whether the image exists (only pulling shows that).
"""

from __future__ import annotations

import re

__all__ = ["image_problem"]

_ALNUM = r"[a-z0-9]+"
_SEPARATOR = r"(?:[._]|__|[-]+)"
_PATH_COMPONENT = rf"{_ALNUM}(?:{_SEPARATOR}{_ALNUM})*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_HOST = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])"
_DOMAIN = rf"{_HOST}(?::[0-9]+)?"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"

_REFERENCE = re.compile(
    rf"(?P<name>(?:(?P<domain>{_DOMAIN})/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*)"
    rf"(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?",
    re.ASCII,
)
_NAME_MAX = 255


def _is_registry(component: str) -> bool:
    return "." in component or ":" in component or component == "localhost"


def image_problem(text: str) -> str | None:
    """Why `text` is not an image reference a runtime can pull (None: it is one)."""
    if text != text.strip() or any(c.isspace() for c in text):
        return "an image reference has no spaces"
    if not text.isascii():
        return "an image reference is ASCII only"
    first, slash, _ = text.partition("/")
    if slash and not _is_registry(first) and first != first.lower():
        return f"repository names are lowercase ({first!r})"
    match = _REFERENCE.fullmatch(text)
    if match is None:
        if text != text.lower() and _REFERENCE.fullmatch(_lower_path(text)):
            return "repository names are lowercase (only a registry host and a tag may have capitals)"
        return (
            "not an image reference: expected [registry[:port]/]name[:tag][@sha256:digest], "
            "e.g. ghcr.io/team/trainer:1.4 (lowercase name; tag of letters, digits, '_', '.', '-')"
        )
    if len(match.group("name")) > _NAME_MAX:
        return f"the image name is longer than {_NAME_MAX} characters"
    return None


def _lower_path(text: str) -> str:
    """`text` with its repository path lowercased (to tell a case problem from any other)."""
    name, at, digest = text.partition("@")
    head, colon, tag = name.rpartition(":")
    if colon and "/" not in tag:
        name = head
    else:
        tag, colon = "", ""
    parts = name.split("/")
    start = 1 if len(parts) > 1 and _is_registry(parts[0]) else 0
    lowered = "/".join(parts[:start] + [p.lower() for p in parts[start:]])
    return f"{lowered}{colon}{tag}{at}{digest}"
