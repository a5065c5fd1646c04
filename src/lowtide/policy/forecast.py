"""An hour-of-week demand profile learned from observed load, for lending by forecast (pure).

Role: remember how much a service needed at each hour of the week, so that mode `forecast` of
`policy.lending` can take GPUs back *before* a ramp it has seen before (the morning peak).
Neighbours: `policy.inference` observes each tick's `ScaleDecision.needed` (ticks with known
data only), asks `peak_within(now, reclaim_lead_s)` and passes the peak to `policy.lending` as
`forecast_needed` / `forecast_at`; `control.inference` persists the profile with `to_dict` /
`from_dict`.
Must not: read the clock (times are passed), do I/O, or change a profile in place (`observe`
returns a new one).

Demand is in units of **needed replicas** (what the load needs, without headroom), so lending
can use a prediction directly. The week has 168 bins, (local weekday, local hour) in the
profile's IANA time zone, so "Monday 08:00" stays 08:00 across DST changes (a skipped hour's bin
gets no sample that week; a repeated hour's bin gets two hours of samples).

Per bin: an exponentially weighted average with a half-life in *time* (default 14 days), not in
samples, so the tick rate does not change how fast old weeks fade:

    on observe(t, v):  w ← w · 2^(−Δ/H) + 1;  s ← s · 2^(−Δ/H) + v;  n ← n + 1
                       (Δ = t − the bin's last observation, ≥ 0; H = half_life_s)
    predict(t)       = s / w of t's bin, or None while n < min_samples (default 10)

Within one hour of one week the samples weigh (almost) the same; a week later the older ones
weigh 2^(−7/14) ≈ 0.71 as much. `peak_within(t, h)` is the highest prediction over (t, t + h]
and the earliest time it starts: t itself for the current hour, else the start of the hour;
`ramp_within(t, h)` the same over the hours that climb (more than the hour before), which is what
mode `forecast` reserves.
Hour boundaries are found at UTC quarter-hours (every time zone in use today is offset by a
multiple of 15 minutes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

HOURS_PER_WEEK = 168
DEFAULT_HALF_LIFE_S = 14 * 86400.0
DEFAULT_MIN_SAMPLES = 10
_FORMAT_VERSION = 1
_QUARTER_S = 900
#: An hour ramps when its mean is at least this fraction (and one replica) above the hour
#: before's: smaller rises are noise of a load that is the same every hour (a bursty one's hourly
#: means differ by a few per cent), which would otherwise hold the mean through half the hours.
RAMP_MIN_RISE = 0.1
_SCAN_LIMIT_S = 8 * 86400.0  # every hour of the week occurs within 8 days, DST included


@dataclass(frozen=True, slots=True)
class HourBin:
    """One hour of the week: decayed Σ value, decayed Σ weight, samples seen, last sample time."""

    weighted_sum: float = 0.0
    weight: float = 0.0
    count: int = 0
    last_at: float | None = None

    @property
    def mean(self) -> float | None:
        return self.weighted_sum / self.weight if self.weight > 0 else None


def _empty_bins() -> tuple[HourBin, ...]:
    return (HourBin(),) * HOURS_PER_WEEK


@dataclass(frozen=True, slots=True)
class WeeklyProfile:
    """Needed replicas by hour of the week in `timezone`; immutable (observe returns a new one)."""

    timezone: str
    half_life_s: float = DEFAULT_HALF_LIFE_S
    min_samples: int = DEFAULT_MIN_SAMPLES
    bins: tuple[HourBin, ...] = field(default_factory=_empty_bins)

    def __post_init__(self) -> None:
        try:
            ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError) as exc:
            raise ValueError(f"unknown time zone {self.timezone!r}") from exc
        if not (math.isfinite(self.half_life_s) and self.half_life_s > 0):
            raise ValueError(f"half_life_s must be a positive number, got {self.half_life_s!r}")
        if self.min_samples < 1:
            raise ValueError(f"min_samples must be at least 1, got {self.min_samples!r}")
        if len(self.bins) != HOURS_PER_WEEK:
            raise ValueError(f"a weekly profile has {HOURS_PER_WEEK} bins, got {len(self.bins)}")

    @classmethod
    def empty(
        cls,
        timezone: str,
        *,
        half_life_s: float = DEFAULT_HALF_LIFE_S,
        min_samples: int = DEFAULT_MIN_SAMPLES,
    ) -> WeeklyProfile:
        return cls(timezone=timezone, half_life_s=half_life_s, min_samples=min_samples)

    # -- learning and predicting ----------------------------------------------------------------

    def hour_of_week(self, t: float) -> int:
        """0 = Monday 00:00–01:00 local time … 167 = Sunday 23:00–24:00."""
        return _hour_of_week(t, ZoneInfo(self.timezone))

    def observe(self, t: float, value: float) -> WeeklyProfile:
        """A new profile that has also seen `value` needed replicas at time `t`."""
        if not math.isfinite(t):
            raise ValueError(f"observation time must be finite, got {t!r}")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"demand must be a finite number ≥ 0, got {value!r}")
        index = self.hour_of_week(t)
        old = self.bins[index]
        last = t if old.last_at is None else max(old.last_at, t)
        decay = 1.0 if old.last_at is None else 0.5 ** (max(t - old.last_at, 0.0) / self.half_life_s)
        new = HourBin(old.weighted_sum * decay + value, old.weight * decay + 1.0, old.count + 1, last)
        bins = (*self.bins[:index], new, *self.bins[index + 1 :])
        return replace(self, bins=bins)

    def samples(self, t: float) -> int:
        """How many observations the bin of `t` has had."""
        return self.bins[self.hour_of_week(t)].count

    def predict(self, t: float) -> float | None:
        """Needed replicas expected at `t`, or None while its bin has fewer than `min_samples`."""
        b = self.bins[self.hour_of_week(t)]
        return b.mean if b.count >= self.min_samples else None

    def peak_within(self, t: float, horizon_s: float) -> tuple[float, float] | None:
        """(value, time) of the highest prediction over (t, t + horizon_s]; the earliest time on
        ties; t itself when the current hour holds the peak. None when no bin there is known."""
        return self._highest(t, horizon_s, ramps_only=False)

    def ramp_within(self, t: float, horizon_s: float) -> tuple[float, float] | None:
        """`peak_within`, counting only hours that ramp: the profile expects clearly more than in
        the hour before (by `RAMP_MIN_RISE` of it and at least one replica; the hour before not
        known yet counts as a ramp). Mode `forecast` reserves by this: an hour's mean says how
        much the hour needs on average, not when within it, so holding it through a flat or
        falling hour only lends less than the load needs now (minute-bursty loads sit below their
        hour's mean most of the time); in an hour that climbs, holding it from `lead` before the
        hour to its end takes the ramp's GPUs back before the ramp."""
        return self._highest(t, horizon_s, ramps_only=True)

    def _highest(self, t: float, horizon_s: float, *, ramps_only: bool) -> tuple[float, float] | None:
        if not (math.isfinite(t) and horizon_s > 0):
            return None
        zone = ZoneInfo(self.timezone)
        end = t + min(horizon_s, _SCAN_LIMIT_S)
        best: tuple[float, float] | None = None

        def consider(at: float, index: int) -> None:
            nonlocal best
            mean = self._known_mean(index)
            if mean is None or (best is not None and mean <= best[0]):
                return
            if ramps_only:
                before = self._known_mean((index - 1) % HOURS_PER_WEEK)
                if before is not None and mean < before + max(1.0, RAMP_MIN_RISE * before):
                    return
            best = (mean, at)

        current = _hour_of_week(t, zone)
        consider(t, current)
        q = (math.floor(t / _QUARTER_S) + 1) * _QUARTER_S
        while q <= end:
            index = _hour_of_week(q, zone)
            if index != current:
                consider(float(q), index)
                current = index
            q += _QUARTER_S
        return best

    def _known_mean(self, index: int) -> float | None:
        b = self.bins[index]
        return b.mean if b.count >= self.min_samples else None

    # -- persistence ----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON-compatible value; `from_dict` reads it back."""
        return {
            "version": _FORMAT_VERSION,
            "timezone": self.timezone,
            "half_life_s": self.half_life_s,
            "min_samples": self.min_samples,
            "bins": [[b.weighted_sum, b.weight, b.count, b.last_at] for b in self.bins],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WeeklyProfile:
        """Read `to_dict`'s value back; anything malformed raises ValueError."""
        try:
            if data.get("version") != _FORMAT_VERSION:
                raise ValueError(f"unsupported weekly profile version {data.get('version')!r}")
            raw_bins = data["bins"]
            if not isinstance(raw_bins, list) or len(raw_bins) != HOURS_PER_WEEK:
                raise ValueError(f"a weekly profile has {HOURS_PER_WEEK} bins")
            bins = tuple(_bin(raw) for raw in raw_bins)
            timezone, half_life, min_samples = data["timezone"], data["half_life_s"], data["min_samples"]
            if not isinstance(timezone, str):
                raise ValueError("timezone must be a string")
            if isinstance(min_samples, bool) or not isinstance(min_samples, int):
                raise ValueError("min_samples must be an integer")
            return cls(timezone=timezone, half_life_s=_number(half_life), min_samples=min_samples, bins=bins)
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"malformed weekly profile: {exc!r}") from exc


def _hour_of_week(t: float, zone: ZoneInfo) -> int:
    local = datetime.fromtimestamp(t, zone)
    return local.weekday() * 24 + local.hour


def _number(x: Any) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
        raise ValueError(f"expected a finite number, got {x!r}")
    return float(x)


def _bin(raw: Any) -> HourBin:
    if not isinstance(raw, list) or len(raw) != 4:
        raise ValueError(f"a bin is [weighted_sum, weight, count, last_at], got {raw!r}")
    weighted_sum, weight, count, last_at = _number(raw[0]), _number(raw[1]), raw[2], raw[3]
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"a bin's count must be an integer ≥ 0, got {count!r}")
    if weighted_sum < 0 or weight < 0 or (count > 0 and weight <= 0):
        raise ValueError(f"inconsistent bin {raw!r}")
    return HourBin(weighted_sum, weight, count, None if last_at is None else _number(last_at))
