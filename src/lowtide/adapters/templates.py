"""Job templates from a directory: `<dir>/<name>.yaml` (or `.yml`, `.json`) for `use: NAME`.

The only file-reading part of spec handling: `domain.spec_document` parses, `domain.spec_parse`
validates and asks a `TemplateLookup` (this class, in production) for template documents. A
template name must follow the job-name rule, so `../x` or `a/b` can never reach the filesystem
(it is simply an unknown template). A file that does not parse raises `SpecInvalid` located with
`template 'NAME': `. Must not: validate a template's content (that is `build_job_spec`'s job,
with the job's params), cache across calls (a new job type is a new file, picked up at once).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from lowtide.domain.spec_document import MAX_SPEC_BYTES, parse_document
from lowtide.domain.spec_issues import SpecInvalid, SpecIssue, is_valid_name, template_prefix

_FORMATS: Mapping[str, Literal["yaml", "json"]] = {".yaml": "yaml", ".yml": "yaml", ".json": "json"}


class DirectoryTemplates:
    """`TemplateLookup` over the template files of one directory (a missing directory has none)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def _files(self, name: str) -> list[Path]:
        return [p for ext in _FORMATS if (p := self.path / f"{name}{ext}").is_file()]

    def load(self, name: str) -> Mapping[str, Any] | None:
        if not is_valid_name(name):
            return None
        files = self._files(name)
        if not files:
            return None
        prefix = template_prefix(name)
        if len(files) > 1:
            found = ", ".join(p.name for p in files)
            raise SpecInvalid([SpecIssue(f"{prefix}(document)", f"more than one file: {found}")])
        path = files[0]
        try:
            with path.open("rb") as f:
                data = f.read(MAX_SPEC_BYTES + 1)  # enough for parse_document to see it is too big
        except OSError as exc:
            raise SpecInvalid([SpecIssue(f"{prefix}(document)", f"cannot read {path}: {exc}")]) from None
        try:
            return parse_document(data, fmt=_FORMATS[path.suffix])
        except SpecInvalid as exc:
            raise SpecInvalid(SpecIssue(prefix + issue.loc, issue.msg) for issue in exc.issues) from None

    def names(self) -> list[str]:
        if not self.path.is_dir():
            return []
        return sorted(
            {
                p.stem
                for p in self.path.iterdir()
                if p.suffix in _FORMATS and is_valid_name(p.stem) and p.is_file()
            }
        )
