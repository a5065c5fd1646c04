"""One typed settings object for a lowtide installation, loaded from ``lowtide.yaml`` plus environment.

Environment variables override the file: ``LOWTIDE_STORE_URL``, ``LOWTIDE_API__PORT`` (nested
fields use ``__``). Relative paths in the file are resolved against the file's directory, so a
config works the same from any working directory. Errors name the field and the reason
(`ConfigError`). Neighbours: `wiring` turns these settings into adapters, the store and the loop.
Must not: open databases, discover GPUs or start anything (NVML discovery lives in
`adapters.gpu_discovery` and runs in `wiring`).
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Any, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from lowtide.control.lease import timing_problem
from lowtide.domain.services import AutoscaleTargets, LendingPolicy, ServiceSpec, TimeWindow
from lowtide.policy.fairshare import FairSharePolicy
from lowtide.policy.scheduler import SchedulerPolicy

DEFAULT_CONFIG_FILE = "lowtide.yaml"
_NAME_RULE = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
#: A node's name: a DNS-1123 subdomain (Kubernetes names nodes so, e.g. `ip-10-0-1-2.ec2.internal`)
#: of at most 63 characters, because cluster mode pins pods with the `kubernetes.io/hostname`
#: label, whose values are at most 63 (docs/cluster.md "Lent GPUs on nodes").
_NODE_NAME_RULE = re.compile(r"(?=.{1,63}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
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
    #: Memory of each GPU (GiB). None: from NVML with ``gpus: auto``, else unknown (a step lent a
    #: sleeping replica's GPU then gets LOWTIDE_GPU_MEMORY_RESERVED_GIB only, no limit figure).
    gpu_memory_gib: float | None = Field(default=None, gt=0)
    #: Host RAM (GiB) that level-1 sleeping replicas may hold on this node (their weights);
    #: beyond it a replica parks by stop. None: no budget.
    sleep_host_ram_gib: float | None = Field(default=None, ge=0)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NODE_NAME_RULE.fullmatch(v):
            raise ValueError(
                "node names use lowercase letters, digits, '-' and '.' between such labels, at most "
                "63 characters (a Kubernetes node name that is also a valid kubernetes.io/hostname "
                "label value, e.g. ip-10-0-1-2.ec2.internal)"
            )
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
    #: Web origins (``https://dash.example.org``) whose pages may call the API from a browser
    #: (CORS). Empty (the default): no CORS headers at all, so no other site's page can read it.
    cors_origins: list[str] = Field(default_factory=list)
    #: Seconds the store may fail before ``/healthz`` answers 503 (docs/architecture.md §4.4).
    store_unhealthy_after: float = Field(default=30.0, gt=0, le=86400, allow_inf_nan=False)
    #: Where the dashboard's Reports page finds simulator reports (``lowtide simulate --out
    #: <this dir>/<name>``); default ``<state_dir>/simulations`` (`Settings.simulation_reports_path`).
    simulation_reports_dir: str | None = None
    #: Origins (``https://dash.example.org``) browsers use to reach the dashboard. Set: a cookie
    #: session's login and unsafe requests must come from one of them; empty (the default): from
    #: the origin the request's Host header names (docs/architecture.md §12).
    dashboard_origins: list[str] = Field(default_factory=list)

    @field_validator("store_unhealthy_after", mode="before")
    @classmethod
    def _unhealthy_after(cls, v: Any) -> float:
        return parse_duration(v)

    @field_validator("cors_origins", "dashboard_origins")
    @classmethod
    def _origins(cls, v: list[str]) -> list[str]:
        for i, origin in enumerate(v):
            if origin == "*" or not re.fullmatch(r"https?://[^/\s*]+", origin):
                raise ValueError(
                    f"[{i}]: {origin!r} is not an origin: give scheme://host[:port] (no path, no '*')"
                )
        return v

    @property
    def is_loopback(self) -> bool:
        """True when the API listens on a loopback address only (127.0.0.0/8, ::1, localhost)."""
        return is_loopback_host(self.host)

    @property
    def url(self) -> str:
        if self.public_url:
            return self.public_url.rstrip("/")
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host  # noqa: S104
        return f"http://{host}:{self.port}"


def is_loopback_host(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: reachable from this machine only."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def auth_exposure_problem(settings: Settings) -> str | None:
    """Why these settings expose an API without auth, or None: auth may be off only while the API
    listens on loopback. Checked when settings load and again by `wiring.serve` (after `--host`)."""
    if settings.auth.enabled or settings.api.is_loopback:
        return None
    return (
        f"auth.enabled: false is allowed only with a loopback api.host (127.0.0.1, ::1, localhost), "
        f"not {settings.api.host!r}: without auth every client that reaches the API acts as admin"
    )


class AuthConfig(_Strict):
    #: False: no tokens, every request acts as the local admin; only with a loopback `api.host`.
    enabled: bool = True
    #: Where the embedded mode stores the admin token it creates on first start (mode 0600).
    admin_token_file: str | None = None
    #: A file holding the admin token to use instead of creating one (a Kubernetes Secret mounted
    #: read-only): registered in the store once, shared by every control plane (cluster mode).
    admin_token_source: str | None = None


class SchedulerConfig(_Strict):
    fair_share_half_life: float = 6 * 3600.0
    team_weights: dict[str, float] = Field(default_factory=dict)
    max_reservations: int = Field(default=1, ge=0)
    #: Walltime of a step whose spec sets no `timeout` (None: no limit; `policy.walltime`).
    default_step_timeout: float | None = None
    #: CPU-only steps (`gpus: 0`) running at once per node: "auto" = 2 × this host's CPUs
    #: (computed by wiring), None = no limit.
    max_cpu_steps_per_node: int | Literal["auto"] | None = "auto"
    #: CPU-only steps running at once per user (the jobs' owner); None = no limit.
    max_cpu_steps_per_user: int | None = Field(default=None, ge=1)
    #: Steps a job may have (checked at submit and validate).
    max_steps_per_job: int = Field(default=1000, ge=1)
    #: Nominal GPUs per team; beyond it a team only borrows idle GPUs (teams not named: no quota).
    team_quotas: dict[str, int] = Field(default_factory=dict)

    @field_validator("fair_share_half_life", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> float:
        seconds = parse_duration(v)
        if seconds <= 0:
            raise ValueError("the half-life must be positive")
        return seconds

    @field_validator("default_step_timeout", mode="before")
    @classmethod
    def _timeout(cls, v: Any) -> float | None:
        if v is None:
            return None
        seconds = parse_duration(v)
        if seconds <= 0:
            raise ValueError("a timeout must be positive (or null: no limit)")
        return seconds

    @field_validator("max_cpu_steps_per_node")
    @classmethod
    def _cpu_limit(cls, v: int | str | None) -> int | str | None:
        if isinstance(v, int) and v < 1:
            raise ValueError('must be at least 1 ("auto": 2 × the CPUs; null: no limit)')
        return v

    @field_validator("team_quotas")
    @classmethod
    def _quotas(cls, v: dict[str, int]) -> dict[str, int]:
        for team, quota in v.items():
            if quota < 0:
                raise ValueError(f"team '{team}': a quota must be 0 or more GPUs")
        return v

    @field_validator("team_weights")
    @classmethod
    def _weights(cls, v: dict[str, float]) -> dict[str, float]:
        for team, weight in v.items():
            if weight <= 0:
                raise ValueError(f"team '{team}': a weight must be positive")
        return v


class ExecutorConfig(_Strict):
    #: ``local`` runs steps on this host; ``argo`` runs each job as an Argo Workflow in a
    #: Kubernetes cluster (needs the ``argo:`` section and a remote artifact root; docs/cluster.md).
    kind: Literal["local", "argo"] = "local"
    #: ``process`` runs a step's command directly; ``docker``/``podman`` run its image.
    runtime: Literal["process", "docker", "podman"] = "process"
    retry_backoff: float = 10.0
    retry_backoff_max: float = 600.0
    #: How often the loop looks for a new ``LATEST`` in each running step's checkpoint dir.
    checkpoint_poll: float = 10.0
    #: A resumed attempt that fails on its own this soon after starting, before any new
    #: checkpoint, crashed on its checkpoint: marked bad, the step is retried from the one
    #: before without using a retry (`policy.checkpoints`). 0 turns this off.
    resume_crash_window: float = 120.0
    #: Run steps as this Unix user's primary group, with one uid per job (`job_uid_base` + the
    #: job's serial), so steps can read neither the state dir nor each other (needs root).
    #: None: steps run as lowtide's own user (`lowtide up` warns). docs/architecture.md §6.4.
    run_as: str | None = None
    #: The first per-job uid; base + 2**28 must stay below 2**32 - 2 (uid_t, minus -1 and nobody).
    job_uid_base: int = 1_500_000_000
    #: Names (``NCCL_*`` globs: a trailing ``*``) passed from lowtide's environment to steps, on
    #: top of PATH, LANG, LC_* and TZ; nothing else of it reaches a step.
    env_allowlist: list[str] = Field(default_factory=list)
    #: Local working dirs and logs of attempts (default: beside local artifacts, in
    #: ``<artifact_root>/work`` with `run_as`, else ``<state_dir>/work``); with `run_as` it must
    #: lie outside the state dir, which steps cannot enter.
    work_root: str | None = None

    @field_validator("retry_backoff", "retry_backoff_max", "checkpoint_poll", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> float:
        return parse_duration(v)

    @field_validator("resume_crash_window", mode="before")
    @classmethod
    def _crash_window(cls, v: Any) -> float:
        seconds = parse_duration(v)
        if not 0 <= seconds <= 86_400:
            raise ValueError("must be between 0 (off) and 1 day")
        return seconds

    @field_validator("run_as")
    @classmethod
    def _run_as(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[a-z_][a-z0-9_.-]{0,31}\$?", v):
            raise ValueError(f"{v!r} is not a Unix user name")
        return v

    @field_validator("job_uid_base")
    @classmethod
    def _uid_base(cls, v: int) -> int:
        if v < 1000 or v + 2**28 >= 2**32 - 2:
            raise ValueError(f"must be between 1000 and {2**32 - 3 - 2**28} (base + 2**28 uids must fit)")
        return v

    @field_validator("work_root")
    @classmethod
    def _work_root(cls, v: str | None) -> str | None:
        if v is not None and not Path(v).is_absolute():
            raise ValueError(f"{v!r} must be an absolute local path")
        return v

    @field_validator("env_allowlist")
    @classmethod
    def _allowlist(cls, v: list[str]) -> list[str]:
        for i, name in enumerate(v):
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*\*?", name):
                raise ValueError(f"[{i}]: {name!r} is not a variable name (or a name prefix ending in *)")
        return v


_WINDOW = re.compile(r"^\s*(\d{1,2}):(\d{2})\s*-\s*(\d{1,2}):(\d{2})\s*$")


def _minute(h: str, m: str) -> int:
    hh, mm = int(h), int(m)
    if hh == 24 and mm == 0:
        return 1440
    if not (0 <= hh < 24 and 0 <= mm < 60):
        raise ValueError(f"{hh:02d}:{mm:02d} is not a time of day")
    return hh * 60 + mm


def parse_window(text: str) -> tuple[int, int]:
    """`"20:00-08:00"` → (1200, 480) minutes after local midnight (may cross midnight)."""
    m = _WINDOW.match(text)
    if not m:
        raise ValueError(f"expected a window like '20:00-08:00', got {text!r}")
    start, end = _minute(m.group(1), m.group(2)), _minute(m.group(3), m.group(4))
    if start == end % 1440:
        raise ValueError(f"window {text!r} is empty")
    return start, end % 1440


def _window_minutes(start: int, end: int) -> set[int]:
    return set(range(start, end)) if start < end else set(range(start, 1440)) | set(range(0, end))


class MetricsConfig(_Strict):
    """Where a service's load comes from: each replica's /metrics, or a Prometheus server."""

    source: Literal["scrape", "prometheus"] = "scrape"
    prometheus_url: str | None = None
    #: PromQL label matchers that select this service's series (with `source: prometheus`).
    selector: str = 'job="vllm"'
    timeout: float = 2.0
    window: float = 60.0
    stale_after: float = 30.0
    frozen_after: float = 120.0

    @field_validator("timeout", "window", "stale_after", "frozen_after", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> float:
        seconds = parse_duration(v)
        if seconds <= 0:
            raise ValueError("must be positive")
        return seconds

    @model_validator(mode="after")
    def _prometheus_url(self) -> MetricsConfig:
        if self.source == "prometheus" and not self.prometheus_url:
            raise ValueError("prometheus_url: required with source: prometheus")
        return self


class AutoscaleConfig(_Strict):
    concurrency_per_replica: float | None = Field(default=32.0, gt=0)
    kv_usage: float | None = Field(default=0.8, gt=0, le=1)
    generation_tokens_per_s_per_replica: float | None = Field(default=None, gt=0)
    token_utilization: float = Field(default=0.8, gt=0, le=1)
    ttft_p90_slo: float | None = None
    scale_up_window: float = 30.0
    scale_down_stabilization: float = 300.0
    #: The burst guard (policy/autoscale.py): a scale-down undone within two stabilisation windows
    #: doubles the window up to this (= scale_down_stabilization: off); it halves again after each
    #: burst_memory without one.
    max_scale_down_stabilization: float = 3600.0
    burst_memory: float = 86400.0
    tolerance: float = Field(default=0.1, ge=0, lt=1)
    #: The band above / below the current count that does not move it (None: `tolerance`); the
    #: down one also bounds the flap guard (policy/autoscale.py).
    scale_up_tolerance: float | None = Field(default=None, ge=0, lt=1)
    scale_down_tolerance: float | None = Field(default=None, ge=0, lt=1)
    #: Knative-style panic window (None: 10 % of scale_up_window) and threshold (× serving replicas).
    panic_window: float | None = None
    panic_threshold: float = Field(default=2.0, ge=1, allow_inf_nan=False)
    #: A scale-up within one scale_up_window goes at most to max(⌈n × rate⌉, n + step); rate None: no cap.
    max_scale_up_rate: float | None = Field(default=2.0, ge=1, allow_inf_nan=False)
    max_scale_up_step: int = Field(default=1, ge=1)
    #: Replicas to have when the metrics have been unknown for fallback_after (None: hold).
    fallback_replicas: int | None = Field(default=None, ge=0)
    fallback_after: float = 60.0

    @field_validator(
        "ttft_p90_slo",
        "scale_up_window",
        "scale_down_stabilization",
        "max_scale_down_stabilization",
        "burst_memory",
        "panic_window",
        "fallback_after",
        mode="before",
    )
    @classmethod
    def _duration(cls, v: Any) -> float | None:
        return None if v is None else parse_duration(v)


class ServiceSimulation(_Strict):
    """Used only by `lowtide simulate`: one replica's capacity and the service's share of the load."""

    #: Requests per second one replica serves at its autoscale target (None: derived from the load).
    replica_capacity_rps: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    #: Fraction of the simulated load this service gets (None: an even split of what is left).
    load_share: float | None = Field(default=None, gt=0, le=1)
    #: TTFT p90 above which a simulated minute counts as an SLO violation (autoscale.ttft_p90_slo wins).
    slo_ttft_p90: float = Field(default=2.0, gt=0, allow_inf_nan=False)


class KubernetesServiceConfig(_Strict):
    """`services[].kubernetes`: the vLLM Deployment whose pods are the service's replicas when
    `manager: kubernetes` (docs/cluster.md "Serving on Kubernetes")."""

    namespace: str
    deployment: str
    #: The port vLLM listens on in the pod (a replica's URL is http://<pod IP>:<port>).
    port: int = Field(default=8000, ge=1, le=65535)
    #: A Service selecting the pods: a pod serves only once its EndpointSlices list it ready.
    endpoint_service: str | None = None
    #: An HPA or KEDA ScaledObject on the same Deployment: `refuse` to scale, or `steer` its bounds.
    on_autoscaler: Literal["refuse", "steer"] = "refuse"
    #: The longest one API request may take (a slow API server delays a tick by at most this).
    request_timeout: float = 5.0

    @field_validator("request_timeout", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> float:
        return parse_duration(v)

    @field_validator("namespace", "deployment", "endpoint_service")
    @classmethod
    def _dns(cls, v: str | None) -> str | None:
        if v is not None and not _NAME_RULE.fullmatch(v):
            raise ValueError(f"{v!r} is not a DNS-1123 label (lowercase letters, digits, '-')")
        return v


class ServiceConfig(_Strict):
    """An inference service lowtide runs (embedded mode) and lends GPUs from."""

    name: str
    model: str
    gpus_per_replica: int = Field(default=1, ge=1)
    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=1, ge=1)
    headroom_replicas: int = Field(default=0, ge=0)
    min_safe_replicas: int | None = Field(default=None, ge=0)
    park: Literal["stop", "sleep"] = "stop"
    #: Who runs the replicas: `local` processes, or the pods of a Kubernetes Deployment that
    #: lowtide scales (`kubernetes:` names it; docs/cluster.md "Serving on Kubernetes").
    manager: Literal["local", "kubernetes"] = "local"
    kubernetes: KubernetesServiceConfig | None = None
    #: vLLM sleep level with ``park: sleep``: 1 offloads the weights to host RAM (fast wake), 2
    #: discards them (the wake reloads them from disk; no host RAM held). docs/vllm.md.
    sleep_level: Literal[1, 2] = 1
    #: GPU memory (GiB per GPU) a sleeping replica still holds (CUDA graphs, NCCL buffers, CUDA
    #: context): steps lent its GPUs get the rest (LOWTIDE_GPU_MEMORY_LIMIT_GIB).
    sleep_residual_gib: float = Field(default=2.0, ge=0)
    #: Host RAM (GiB) one level-1 sleeping replica holds: the model's weights. None: unknown (on a
    #: node with ``sleep_host_ram_gib`` it is counted as that whole budget).
    weights_host_gib: float | None = Field(default=None, gt=0)
    #: The replica command; {model}, {port}, {gpus} and {python} are filled in. Default: `vllm serve`
    #: bound to 127.0.0.1 (with --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1 when park is sleep),
    #: or the emulator when `emulate: true` (docs/vllm.md).
    command: list[str] | None = None
    #: Run lowtide's vLLM emulator instead of vLLM (machines without GPUs: demo, tests).
    emulate: bool = False
    emulator_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    base_port: int = Field(default=8100, ge=1, le=65535)
    #: The stable OpenAI-compatible address clients use; None: no gateway.
    gateway_port: int | None = Field(default=None, ge=0, le=65535)
    startup_timeout: float = 600.0
    expected_startup: float = 120.0
    expected_wake: float = 10.0
    drain_timeout: float = 30.0
    #: The longest notice a research step gets when this service takes its GPUs back.
    reclaim_grace: float = 60.0
    #: A serving replica whose own metrics fail (or freeze with requests in flight) this long, or
    #: whose requests fail 3 times in a row at the gateway, is hung: taken out and restarted.
    #: None: never (vLLM's /health stays 200 while its engine is stuck).
    hung_after: float | None = 30.0
    #: How long the gateway waits for a replica's next bytes (the first of a non-streamed answer).
    gateway_read_timeout: float = 600.0
    #: Requests the gateway holds while the service has no replica serving (scale from zero: held
    #: requests are demand, a replica is started or woken for them); one more gets 503. 0: no hold.
    gateway_queue: int = Field(default=256, ge=0)
    #: How long a held request waits for a replica before a 503. None: expected_startup + 60 s.
    gateway_queue_timeout: float | None = None
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    autoscale: AutoscaleConfig = Field(default_factory=AutoscaleConfig)
    simulation: ServiceSimulation = Field(default_factory=ServiceSimulation)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME_RULE.match(v):
            raise ValueError("service names use lowercase letters, digits and '-' (at most 63)")
        return v

    @field_validator(
        "startup_timeout",
        "expected_startup",
        "expected_wake",
        "drain_timeout",
        "reclaim_grace",
        "gateway_read_timeout",
        mode="before",
    )
    @classmethod
    def _duration(cls, v: Any) -> float:
        return parse_duration(v)

    @field_validator("hung_after", "gateway_queue_timeout", mode="before")
    @classmethod
    def _optional_duration(cls, v: Any) -> float | None:
        return None if v is None else parse_duration(v)

    @field_validator("hung_after", "gateway_read_timeout", "gateway_queue_timeout")
    @classmethod
    def _positive(cls, v: float | None) -> float | None:
        if v is not None and v <= 0:
            raise ValueError("must be a positive duration")
        return v

    @model_validator(mode="after")
    def _replicas(self) -> ServiceConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) is larger than max_replicas ({self.max_replicas})"
            )
        if self.min_safe_replicas is not None and self.min_safe_replicas > self.max_replicas:
            raise ValueError(
                f"min_safe_replicas ({self.min_safe_replicas}) is larger than "
                f"max_replicas ({self.max_replicas})"
            )
        if self.base_port + self.max_replicas - 1 > 65535:
            raise ValueError("base_port + max_replicas goes past port 65535")
        if self.command is not None and not self.command:
            raise ValueError("command: give the program and its arguments")
        if self.manager == "kubernetes":
            if self.kubernetes is None:
                raise ValueError(
                    "manager: kubernetes needs `kubernetes: {namespace, deployment}` naming the vLLM "
                    "Deployment"
                )
            if self.park == "sleep":
                raise ValueError(
                    "park: sleep cannot be used with manager: kubernetes: a sleeping vLLM pod keeps "
                    "its GPU allocation (nvidia.com/gpu stays requested), so nothing could be lent; "
                    "use park: stop (the Deployment is scaled down)"
                )
        elif self.kubernetes is not None:
            raise ValueError("kubernetes: is only used with manager: kubernetes")
        return self

    def replica_ports(self) -> list[int]:
        return [self.base_port + slot for slot in range(self.max_replicas)]


class LendingConfig(_Strict):
    """When research may use GPUs that inference does not need."""

    mode: Literal["continuous", "window", "forecast"] = "continuous"
    #: Local-time windows for mode `window`, e.g. ["20:00-08:00"]; they may not overlap.
    windows: list[str] = Field(default_factory=list)
    timezone: str = "UTC"
    stale_after: float = 30.0
    stale_reclaim_after: float = 120.0

    @field_validator("stale_after", "stale_reclaim_after", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> float:
        return parse_duration(v)

    @field_validator("timezone")
    @classmethod
    def _tz(cls, v: str) -> str:
        try:
            ZoneInfo(v)
        except (ZoneInfoNotFoundError, ValueError) as exc:
            raise ValueError(f"unknown time zone {v!r} (use an IANA name such as Europe/Berlin)") from exc
        return v

    @field_validator("windows")
    @classmethod
    def _windows(cls, v: list[str]) -> list[str]:
        seen: list[tuple[str, set[int]]] = []
        for text in v:
            start, end = parse_window(text)
            minutes = _window_minutes(start, end)
            for other, other_minutes in seen:
                if minutes & other_minutes:
                    raise ValueError(f"windows {other!r} and {text!r} overlap")
            seen.append((text, minutes))
        return v

    @model_validator(mode="after")
    def _mode(self) -> LendingConfig:
        if self.mode == "window" and not self.windows:
            raise ValueError("windows: mode 'window' needs at least one window, e.g. ['20:00-08:00']")
        if self.stale_reclaim_after < self.stale_after:
            raise ValueError("stale_reclaim_after must not be shorter than stale_after")
        return self


class AccountingConfig(_Strict):
    """Usage reports (`lowtide report`): what a GPU-hour of research would cost elsewhere, and
    the time zone whose days they count in (default: `lending.timezone`)."""

    price_per_gpu_hour: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    #: An ISO 4217 code such as USD or EUR.
    currency: str = Field(default="USD", pattern=r"^[A-Z]{3}$")
    timezone: str | None = None

    @field_validator("timezone")
    @classmethod
    def _tz(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                ZoneInfo(v)
            except (ZoneInfoNotFoundError, ValueError, OSError) as exc:
                raise ValueError(f"unknown time zone {v!r} (use an IANA name such as Europe/Berlin)") from exc
        return v


class SecretSourceConfig(_Strict):
    """Where a secret's value is read at launch: a `file` (an absolute path, read whole, one
    trailing newline dropped) or `env`, a variable of lowtide's own environment."""

    file: str | None = None
    env: str | None = None

    @model_validator(mode="after")
    def _one(self) -> SecretSourceConfig:
        if (self.file is None) == (self.env is None):
            raise ValueError("give exactly one of file: PATH or env: VARIABLE")
        if self.file is not None and not Path(self.file).is_absolute():
            raise ValueError(f"file: {self.file!r} must be an absolute path")
        if self.env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.env):
            raise ValueError(f"env: {self.env!r} is not a variable name")
        return self


class SecretConfig(_Strict):
    """One secret jobs may name by reference (`secrets:` in a spec; docs/architecture.md §11):
    the variable it fills in the step's environment, the teams whose jobs may use it ("*": all),
    and its source. Only its name is ever stored or shown; the value is read at launch."""

    env: str
    teams: list[str] = Field(min_length=1)
    source: SecretSourceConfig

    @field_validator("env")
    @classmethod
    def _env(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v):
            raise ValueError(f"{v!r} is not a variable name (letters, digits and '_')")
        if v.upper().startswith("LOWTIDE_") or v == "CUDA_VISIBLE_DEVICES":
            raise ValueError(f"{v!r} is reserved: lowtide sets it (the step contract)")
        return v

    @field_validator("teams")
    @classmethod
    def _teams(cls, v: list[str]) -> list[str]:
        for i, team in enumerate(v):
            if team != "*" and not _NAME_RULE.fullmatch(team):
                raise ValueError(f"[{i}]: {team!r} is not a team name (or '*' for every team)")
        return v


class ArgoConfig(_Strict):
    """Cluster mode: how a job becomes an Argo Workflow (`argo:`; docs/cluster.md "Jobs as Argo
    Workflows"). The admission gate's name is fixed (`lowtide.io/admission`). `artifact_root`
    (default: the top-level one) must be remote object storage, e.g. ``s3://bucket/prefix``."""

    namespace: str = "lowtide"
    service_account: str | None = None
    research_priority_class: str = "lowtide-research"
    #: Added to a job's grace for its pods' terminationGracePeriodSeconds.
    grace_margin_seconds: float = Field(default=15.0, ge=0, le=3600, allow_inf_nan=False)
    #: The code the in-image shim exits with when the step was interrupted (75: EX_TEMPFAIL).
    interrupted_exit_code: int = Field(default=75, ge=1, le=125)
    shim_command: list[str] = Field(default_factory=lambda: ["lowtide-step-shim", "--"], min_length=1)
    #: The image of steps that name none (None: every step must name one).
    default_image: str | None = None
    artifact_root: str | None = None
    api_url: str | None = None
    #: A Kubernetes Secret whose keys become env of every step (object storage credentials).
    storage_secret: str | None = None
    #: The key of a job secret's value in the Kubernetes Secret named like the lowtide secret.
    secret_key: str = "value"  # noqa: S105 - the name of a key in a Secret, not a value
    #: `executor.kind: argo`: the kubeconfig file to reach the cluster (None: the pod's
    #: ServiceAccount in a cluster, else KUBECONFIG or ~/.kube/config).
    kubeconfig: str | None = None
    #: Where Workflows are created, read and stopped (docs/cluster.md "Submission paths"): the
    #: Kubernetes API, or argo-server's REST API (pods are always read through Kubernetes).
    submit_via: Literal["kubernetes", "argo-server"] = "kubernetes"
    #: `submit_via: argo-server`: its base URL, e.g. https://argo-server.argo:2746
    server_url: str | None = None
    #: A file holding the bearer token argo-server accepts (never the token itself in config).
    server_token_file: str | None = None
    server_verify_tls: bool = True

    @field_validator("server_url")
    @classmethod
    def _server_url(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"https?://[^\s/]+(/\S*)?", v):
            raise ValueError(f"{v!r} must be an http:// or https:// URL (e.g. https://argo-server.argo:2746)")
        return v

    @model_validator(mode="after")
    def _argo_server(self) -> ArgoConfig:
        if self.submit_via == "argo-server" and not self.server_url:
            raise ValueError("server_url: required with submit_via: argo-server")
        return self

    @field_validator("grace_margin_seconds", mode="before")
    @classmethod
    def _margin(cls, v: Any) -> float:
        return parse_duration(v)

    @field_validator("namespace", "research_priority_class", "service_account", "storage_secret")
    @classmethod
    def _dns_names(cls, v: str | None) -> str | None:
        if v is not None and not _NAME_RULE.fullmatch(v):
            raise ValueError(f"{v!r} is not a DNS-1123 label (lowercase letters, digits, '-')")
        return v

    @field_validator("artifact_root")
    @classmethod
    def _remote(cls, v: str | None) -> str | None:
        if v is not None and ("://" not in v or v.startswith(("file://", "memory://"))):
            raise ValueError(f"{v!r} must be remote object storage (e.g. s3://bucket/prefix)")
        return v


class KubernetesLeaseConfig(_Strict):
    """The `coordination.k8s.io/v1` Lease that elects the leader when `control.lease_backend` is
    `kubernetes` (`adapters.k8s_lease`); its duration is `control.lease_ttl` rounded up."""

    #: The Lease's namespace; default: the pod's own (the ServiceAccount's namespace file), else
    #: the namespace of the KUBECONFIG context, else "default".
    namespace: str | None = None
    name: str = "lowtide-control"

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str | None) -> str | None:
        if v is not None and not _K8S_LABEL.fullmatch(v):
            raise ValueError(f"{v!r} is not a valid namespace (a DNS-1123 label: a-z, 0-9, '-', at most 63)")
        return v

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _K8S_SUBDOMAIN.fullmatch(v):
            raise ValueError(f"{v!r} is not a valid Lease name (a DNS-1123 subdomain: a-z, 0-9, '-', '.')")
        return v


#: Kubernetes object names (apimachinery pkg/util/validation: DNS-1123 label / subdomain).
_K8S_LABEL = re.compile(r"(?=.{1,63}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_K8S_SUBDOMAIN = re.compile(r"(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


class ControlConfig(_Strict):
    """The one active control plane (docs/architecture.md §4.4): several `lowtide up` may share a
    store; the holder of its lease acts, the others stand by and take over when it expires."""

    #: Who elects the leader: `store` (the store's lease alone) or `kubernetes` (a
    #: coordination.k8s.io Lease, `kubernetes_lease`; its holder then claims the store's lease,
    #: which still fences the writes; a control plane that loses the Lease exits, code 1).
    lease_backend: Literal["store", "kubernetes"] = "store"
    kubernetes_lease: KubernetesLeaseConfig = Field(default_factory=KubernetesLeaseConfig)

    #: How long the lease lasts without a renew: a standby takes over at most this long (plus
    #: `lease_renew`) after the leader died; the leader stops acting at 80 % of it after its
    #: last renew began.
    lease_ttl: float = 15.0
    #: How often the leader renews the lease and a standby tries to take it; at most 0.4 × the ttl.
    lease_renew: float = 5.0
    #: After taking over the expired lease of *another host*, wait this long before recovering
    #: (recovery requeues the attempts it cannot find on this host as lost).
    foreign_takeover_grace: float = 300.0
    #: Where the gateway process keeps its routing table, status and identity (default
    #: ``<state_dir>/gateway``). A hot standby on the same host must share it with the leader, so
    #: that whichever leads adopts the one gateway that holds the ports (a private directory both
    #: can write; lowtide keeps it 0700).
    gateway_dir: str | None = None

    @field_validator("lease_ttl", "lease_renew", "foreign_takeover_grace", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> float:
        return parse_duration(v)

    @model_validator(mode="after")
    def _timing(self) -> ControlConfig:
        problem = timing_problem(self.lease_ttl, self.lease_renew)
        if problem:
            raise ValueError(problem)
        if not 1 <= self.lease_ttl <= 3600:
            raise ValueError("lease_ttl: between 1 s and 1 h")
        return self


class Settings(BaseSettings):
    """Everything a lowtide installation is configured with."""

    model_config = SettingsConfigDict(
        env_prefix="LOWTIDE_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    #: Local state: the SQLite database, tokens, working directories and logs.
    state_dir: str = ".lowtide"
    #: SQLAlchemy URL; default ``sqlite:///<state_dir>/lowtide.db``; production: ``postgresql+psycopg://...``
    store_url: str | None = None
    #: How long `lowtide up` waits for a store that does not answer yet (a database still starting)
    #: before it gives up; every try is logged.
    store_start_timeout: float = Field(default=300.0, ge=0, le=86400, allow_inf_nan=False)
    #: How long a write waits for a lock another connection holds before it fails as a store
    #: outage (SQLite busy_timeout, PostgreSQL lock_timeout; retried; docs/architecture.md §4.4).
    store_busy_timeout: float = Field(default=5.0, gt=0, le=600, allow_inf_nan=False)
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
    #: Inference services lowtide scales and lends from (none: every GPU is research's).
    services: list[ServiceConfig] = Field(default_factory=list)
    lending: LendingConfig = Field(default_factory=LendingConfig)
    accounting: AccountingConfig = Field(default_factory=AccountingConfig)
    #: The lease that makes one of several `lowtide up` on one store the acting one.
    control: ControlConfig = Field(default_factory=ControlConfig)
    #: Secrets jobs may name by reference, by name (docs/architecture.md §11).
    secrets: dict[str, SecretConfig] = Field(default_factory=dict)
    #: Cluster mode: jobs as Argo Workflows (`lowtide argo render`).
    argo: ArgoConfig = Field(default_factory=ArgoConfig)

    @field_validator("secrets")
    @classmethod
    def _secret_names(cls, v: dict[str, SecretConfig]) -> dict[str, SecretConfig]:
        for name in v:
            if not _NAME_RULE.fullmatch(name):
                raise ValueError(f"{name!r} is not a valid secret name (lowercase letters, digits, '-')")
        return v

    @field_validator("store_busy_timeout", "store_start_timeout", mode="before")
    @classmethod
    def _busy(cls, v: Any) -> float:
        return parse_duration(v)

    @field_validator("tick_seconds", mode="before")
    @classmethod
    def _tick(cls, v: Any) -> float:
        seconds = parse_duration(v)
        if not 0.05 <= seconds <= 3600:
            raise ValueError("the tick must be between 0.05 s and 1 h")
        return seconds

    @model_validator(mode="after")
    def _argo_executor(self) -> Settings:
        if self.executor.kind != "argo":
            return self
        root = self.argo.artifact_root or self.artifact_root
        if not root or "://" not in root or root.startswith(("file://", "memory://")):
            raise ValueError(
                f"executor.kind: argo needs remote object storage for artifacts (argo.artifact_root or "
                f"artifact_root, e.g. s3://bucket/prefix); got {root!r}: pods cannot reach lowtide's disk"
            )
        if self.executor.runtime != "process":
            raise ValueError(
                "executor.runtime: with executor.kind: argo the cluster runs the images; leave it unset"
            )
        return self

    @model_validator(mode="after")
    def _auth_off_only_on_loopback(self) -> Settings:
        problem = auth_exposure_problem(self)
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _unique_nodes(self) -> Settings:
        names = [n.name for n in self.nodes]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"nodes: duplicate node name(s): {', '.join(dupes)}")
        if not self.nodes:
            raise ValueError("nodes: declare at least one node")
        return self

    @model_validator(mode="after")
    def _services_fit(self) -> Settings:
        names = [s.name for s in self.services]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"services: duplicate service name(s): {', '.join(dupes)}")
        largest = max(
            (n.gpus if isinstance(n.gpus, int) else len(n.gpus) if isinstance(n.gpus, list) else 1024)
            for n in self.nodes
        )
        used: dict[int, str] = {self.api.port: "api.port"} if self.api.port else {}
        for i, svc in enumerate(self.services):
            if svc.gpus_per_replica > largest:
                raise ValueError(
                    f"services[{i}].gpus_per_replica: {svc.gpus_per_replica} GPUs "
                    f"but the largest node has {largest}"
                )
            # A Kubernetes-managed service's replicas listen in their pods, not on this host.
            local = svc.manager == "local"
            ports = {p: f"services[{i}] replica {p - svc.base_port}" for p in svc.replica_ports() if local}
            if svc.gateway_port is not None:
                ports[svc.gateway_port] = f"services[{i}].gateway_port"
            for port, what in ports.items():
                if port in used:
                    raise ValueError(f"{what}: port {port} is already used by {used[port]}")
                used[port] = what
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
    def simulation_reports_path(self) -> Path:
        """`api.simulation_reports_dir`, else ``<state_dir>/simulations``."""
        where = self.api.simulation_reports_dir
        return Path(where) if where else self.state_path / "simulations"

    @property
    def accounting_timezone(self) -> str:
        """The time zone of report days: `accounting.timezone`, else `lending.timezone`."""
        return self.accounting.timezone or self.lending.timezone

    @property
    def database_url(self) -> str:
        return self.store_url or f"sqlite:///{self.state_path / 'lowtide.db'}"

    @property
    def artifacts(self) -> str:
        return self.artifact_root or str(self.state_path / "artifacts")

    @property
    def work_root(self) -> str:
        """Local working directories and logs: `executor.work_root`, else beside the artifacts
        when those are local (in ``<artifact_root>/work`` with `executor.run_as`: a job's
        artifact dir belongs to its steps, so the work dirs, whose parents lowtide must own,
        cannot be inside it; docs/architecture.md §6.4)."""
        if self.executor.work_root:
            return self.executor.work_root
        root = self.artifacts
        if "://" in root and not root.startswith("file://"):
            return str(self.state_path / "work")
        local = root.removeprefix("file://")
        return f"{local.rstrip('/')}/work" if self.executor.run_as else local

    @property
    def gateway_path(self) -> Path:
        return Path(self.control.gateway_dir or self.state_path / "gateway")

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
    control = out.get("control")
    if isinstance(control, dict) and isinstance(control.get("gateway_dir"), str):
        gateway_dir = Path(control["gateway_dir"])
        if not gateway_dir.is_absolute():
            out["control"] = {**control, "gateway_dir": str((base / gateway_dir).resolve())}
    auth = out.get("auth")
    if isinstance(auth, dict) and isinstance(auth.get("admin_token_file"), str):
        path = Path(auth["admin_token_file"])
        if not path.is_absolute():
            out["auth"] = {**auth, "admin_token_file": str((base / path).resolve())}
    api = out.get("api")
    if isinstance(api, dict) and isinstance(api.get("simulation_reports_dir"), str):
        path = Path(api["simulation_reports_dir"])
        if not path.is_absolute():
            out["api"] = {**api, "simulation_reports_dir": str((base / path).resolve())}
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


# -- configuration as the domain's values (used by wiring and the simulator) -------------------


def service_spec(cfg: ServiceConfig) -> ServiceSpec:
    a = cfg.autoscale
    return ServiceSpec(
        name=cfg.name,
        model=cfg.model,
        gpus_per_replica=cfg.gpus_per_replica,
        min_replicas=cfg.min_replicas,
        max_replicas=cfg.max_replicas,
        headroom_replicas=cfg.headroom_replicas,
        min_safe_replicas=cfg.min_replicas if cfg.min_safe_replicas is None else cfg.min_safe_replicas,
        park=cfg.park,
        startup_s=cfg.expected_startup,
        wake_s=cfg.expected_wake,
        sleep_level=cfg.sleep_level,
        sleep_residual_gib=cfg.sleep_residual_gib,
        weights_host_gib=cfg.weights_host_gib,
        autoscale=AutoscaleTargets(
            concurrency_per_replica=a.concurrency_per_replica,
            kv_usage=a.kv_usage,
            generation_tokens_per_s_per_replica=a.generation_tokens_per_s_per_replica,
            token_utilization=a.token_utilization,
            ttft_p90_slo_s=a.ttft_p90_slo,
            scale_up_window_s=a.scale_up_window,
            scale_down_stabilization_s=a.scale_down_stabilization,
            max_scale_down_stabilization_s=max(a.max_scale_down_stabilization, a.scale_down_stabilization),
            burst_memory_s=a.burst_memory,
            tolerance=a.tolerance,
            scale_up_tolerance=a.scale_up_tolerance,
            scale_down_tolerance=a.scale_down_tolerance,
            panic_window_s=a.panic_window,
            panic_threshold=a.panic_threshold,
            max_scale_up_rate=a.max_scale_up_rate,
            max_scale_up_step=a.max_scale_up_step,
            fallback_replicas=a.fallback_replicas,
            fallback_after_s=a.fallback_after,
        ),
    )


def scheduler_policy(settings: Settings, *, cpus_per_node: int | None) -> SchedulerPolicy:
    """Config `scheduler:` as the scheduler's policy. `max_cpu_steps_per_node: auto` is 2 ×
    `cpus_per_node` (wiring passes this host's CPU count; the simulator None: no limit)."""
    cfg = settings.scheduler
    cpu_limit = cfg.max_cpu_steps_per_node
    if cpu_limit == "auto":
        cpu_limit = None if cpus_per_node is None else 2 * cpus_per_node
    return SchedulerPolicy(
        fair_share=FairSharePolicy(half_life_s=cfg.fair_share_half_life, team_weights=dict(cfg.team_weights)),
        max_reservations=cfg.max_reservations,
        max_cpu_steps_per_node=cpu_limit,
        max_cpu_steps_per_user=cfg.max_cpu_steps_per_user,
        team_quotas=dict(cfg.team_quotas),
    )


def lending_policy(settings: Settings) -> LendingPolicy:
    lend = settings.lending
    specs = [service_spec(s) for s in settings.services]
    # Time to get GPUs back and a replica serving: a tick, the longest notice, the slowest unpark.
    lead = settings.tick_seconds + max(
        (s.reclaim_grace + spec.unpark_s for s, spec in zip(settings.services, specs, strict=True)),
        default=0.0,
    )
    return LendingPolicy(
        mode=lend.mode,
        windows=tuple(TimeWindow(*parse_window(w)) for w in lend.windows),
        timezone=lend.timezone,
        reclaim_lead_s=lead,
        stale_after_s=lend.stale_after,
        stale_reclaim_after_s=lend.stale_reclaim_after,
    )
