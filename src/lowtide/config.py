"""One typed settings object for a lowtide installation, loaded from ``lowtide.yaml`` plus environment.

Environment variables override the file: ``LOWTIDE_STORE_URL``, ``LOWTIDE_API__PORT`` (nested
fields use ``__``). Relative paths in the file are resolved against the file's directory, so a
config works the same from any working directory. Errors name the field and the reason
(`ConfigError`). Neighbours: `wiring` turns these settings into adapters, the store and the loop.
Must not: open databases, discover GPUs or start anything (NVML discovery lives in
`adapters.gpu_discovery` and runs in `wiring`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

DEFAULT_CONFIG_FILE = "lowtide.yaml"
_NAME_RULE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names the file, the field and why."""


def parse_duration(value: Any) -> float:
    """Seconds from a number or a string like ``90``, ``30s``, ``5m``, ``6h``, ``1d``."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 30, '30s', '5m' or '6h'")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION.match(value)):
        seconds = float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
    else:
        raise ValueError(f"expected a duration such as 30, '30s', '5m' or '6h', got {value!r}")
    if seconds < 0:
        raise ValueError("a duration cannot be negative")
    return seconds


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NodeConfig(_Strict):
    """A host and its GPUs: ``auto`` (discover with NVML), a count, or an explicit list of indices."""

    name: str = "local"
    gpus: Literal["auto"] | int | list[int] = "auto"

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME_RULE.match(v):
            raise ValueError("node names use lowercase letters, digits and '-' (at most 63)")
        return v

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, v: Any) -> Any:
        if isinstance(v, int) and not 0 <= v <= 1024:
            raise ValueError("a GPU count must be between 0 and 1024")
        if isinstance(v, list):
            if len(set(v)) != len(v):
                raise ValueError("GPU indices must be unique")
            if any(i < 0 for i in v):
                raise ValueError("GPU indices cannot be negative")
        return v


class ApiConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8470, ge=0, le=65535)
    #: The address steps and the CLI use to reach the API (defaults to http://host:port).
    public_url: str | None = None

    @property
    def url(self) -> str:
        if self.public_url:
            return self.public_url.rstrip("/")
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host  # noqa: S104
        return f"http://{host}:{self.port}"


class AuthConfig(_Strict):
    enabled: bool = True
    #: Where the embedded mode stores the admin token it creates on first start (mode 0600).
    admin_token_file: str | None = None


class SchedulerConfig(_Strict):
    fair_share_half_life: float = 6 * 3600.0
    team_weights: dict[str, float] = Field(default_factory=dict)
    max_reservations: int = Field(default=1, ge=0)

    @field_validator("fair_share_half_life", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> float:
        seconds = parse_duration(v)
        if seconds <= 0:
            raise ValueError("the half-life must be positive")
        return seconds

    @field_validator("team_weights")
    @classmethod
    def _weights(cls, v: dict[str, float]) -> dict[str, float]:
        for team, weight in v.items():
            if weight <= 0:
                raise ValueError(f"team '{team}': a weight must be positive")
        return v


class ExecutorConfig(_Strict):
    #: ``process`` runs a step's command directly; ``docker``/``podman`` run its image.
    runtime: Literal["process", "docker", "podman"] = "process"
    retry_backoff: float = 10.0
    retry_backoff_max: float = 600.0
    #: How often the loop looks for a new ``LATEST`` in each running step's checkpoint dir.
    checkpoint_poll: float = 10.0

    @field_validator("retry_backoff", "retry_backoff_max", "checkpoint_poll", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> float:
        return parse_duration(v)


class Settings(BaseSettings):
    """Everything a lowtide installation is configured with."""

    model_config = SettingsConfigDict(
        env_prefix="LOWTIDE_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    #: Local state: the SQLite database, tokens, working directories and logs.
    state_dir: str = ".lowtide"
    #: SQLAlchemy URL; default ``sqlite:///<state_dir>/lowtide.db``; production: ``postgresql+psycopg://...``
    store_url: str | None = None
    #: Inputs, outputs and checkpoints: a local path or any fsspec URL (``s3://bucket/prefix``).
    artifact_root: str | None = None
    #: fsspec storage options for the artifact root (``endpoint_url``, ``key``, ``secret``...).
    artifact_options: dict[str, Any] = Field(default_factory=dict)
    templates_dir: str = "templates"
    tick_seconds: float = 2.0
    nodes: list[NodeConfig] = Field(default_factory=lambda: [NodeConfig()])
    api: ApiConfig = Field(default_factory=ApiConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    executor: ExecutorConfig = Field(default_factory=ExecutorConfig)
    #: Reserved for inference services and lending policies (the inference issue adds them).
    services: list[dict[str, Any]] = Field(default_factory=list)

    @field_validator("tick_seconds", mode="before")
    @classmethod
    def _tick(cls, v: Any) -> float:
        seconds = parse_duration(v)
        if not 0.05 <= seconds <= 3600:
            raise ValueError("the tick must be between 0.05 s and 1 h")
        return seconds

    @field_validator("services")
    @classmethod
    def _services(cls, v: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if v:
            raise ValueError("inference services are not supported by this version of lowtide yet")
        return v

    @model_validator(mode="after")
    def _unique_nodes(self) -> Settings:
        names = [n.name for n in self.nodes]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"nodes: duplicate node name(s): {', '.join(dupes)}")
        if not self.nodes:
            raise ValueError("nodes: declare at least one node")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The environment overrides the file (init kwargs carry the file's content).
        return (env_settings, init_settings)

    # -- derived locations -------------------------------------------------------------------

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir)

    @property
    def database_url(self) -> str:
        return self.store_url or f"sqlite:///{self.state_path / 'lowtide.db'}"

    @property
    def artifacts(self) -> str:
        return self.artifact_root or str(self.state_path / "artifacts")

    @property
    def work_root(self) -> str:
        """Local working directories and logs: beside the artifacts when those are local."""
        root = self.artifacts
        if "://" in root and not root.startswith("file://"):
            return str(self.state_path / "work")
        return root.removeprefix("file://")

    @property
    def admin_token_path(self) -> Path:
        return Path(self.auth.admin_token_file or self.state_path / "admin.token")


def _resolve_paths(doc: dict[str, Any], base: Path) -> dict[str, Any]:
    """Make relative local paths in the file relative to the file's directory."""
    out = dict(doc)
    for key in ("state_dir", "templates_dir", "artifact_root"):
        value = out.get(key)
        if isinstance(value, str) and "://" not in value and not Path(value).is_absolute():
            out[key] = str((base / value).resolve())
    store = out.get("store_url")
    if isinstance(store, str) and store.startswith("sqlite:///") and not store.startswith("sqlite:////"):
        rel = store.removeprefix("sqlite:///")
        if rel and rel != ":memory:":
            out["store_url"] = f"sqlite:///{(base / rel).resolve()}"
    auth = out.get("auth")
    if isinstance(auth, dict) and isinstance(auth.get("admin_token_file"), str):
        path = Path(auth["admin_token_file"])
        if not path.is_absolute():
            out["auth"] = {**auth, "admin_token_file": str((base / path).resolve())}
    return out


def format_validation_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = ""
        for part in e["loc"]:
            loc += f"[{part}]" if isinstance(part, int) else (f".{part}" if loc else str(part))
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = f"unknown key '{e['loc'][-1]}'"
        lines.append(f"{source}: {loc or '(document)'}: {msg}")
    return "\n".join(lines)


def load_settings(path: str | Path | None = None, **overrides: Any) -> Settings:
    """Load settings from `path` (or ``$LOWTIDE_CONFIG``, or ./lowtide.yaml when present).

    A missing explicit file is an error; with no file at all the defaults apply.
    """
    explicit = path or os.environ.get("LOWTIDE_CONFIG")
    file = Path(explicit) if explicit else Path(DEFAULT_CONFIG_FILE)
    doc: dict[str, Any] = {}
    source = "(defaults)"
    if file.exists():
        source = str(file)
        try:
            loaded = yaml.safe_load(file.read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{file}: not valid YAML: {exc}") from exc
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{file}: the top level must be a mapping of settings")
        doc = _resolve_paths(loaded, file.resolve().parent)
    elif explicit:
        raise ConfigError(f"{file}: configuration file not found")
    doc.update(overrides)
    try:
        return Settings(**doc)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source)) from exc
