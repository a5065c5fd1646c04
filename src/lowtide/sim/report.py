"""`report.html` of a simulated run: the summary as a table and four PNG plots, in one file.

Plots (matplotlib, Agg backend, embedded as base64 PNG so the page is self-contained): GPUs by
holder over time (serving replicas, other replica states, research, idle), load against serving
capacity, the lending envelope against what research holds, and the queue of waiting steps.
Every value printed comes from the summary or the run's samples and is HTML-escaped.
Neighbours: `sim.world` (the samples), `sim.summary`, `cli.simulate_cmd` (writes the file).
Must not: run the simulation or read anything but its arguments.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from lowtide.sim.world import Sample

#: At most this many points per plotted series (a 90-day run has tens of thousands of samples).
MAX_POINTS = 4000


def _thin(samples: Sequence[Sample]) -> list[Sample]:
    if len(samples) <= MAX_POINTS:
        return list(samples)
    step = len(samples) / MAX_POINTS
    return [samples[int(i * step)] for i in range(MAX_POINTS)]


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def plots(samples: Sequence[Sample], start: float, pool_gpus: int) -> dict[str, str]:
    """Title → base64 PNG."""
    pts = _thin(samples)
    if not pts:
        return {}
    days = [(p.at - start) / 86400.0 for p in pts]
    out: dict[str, str] = {}

    fig, ax = plt.subplots(figsize=(10, 3.2))
    serving = [p.serving_gpus for p in pts]
    other = [p.replica_gpus - p.serving_gpus for p in pts]
    research = [p.research_gpus for p in pts]
    idle = [max(0, pool_gpus - p.replica_gpus - p.research_gpus) for p in pts]
    ax.stackplot(
        days,
        serving,
        other,
        research,
        idle,
        labels=["serving", "starting/waking/draining", "research", "idle"],
        step="post",
        colors=["#3b6ea5", "#9ab8d8", "#e07b39", "#dddddd"],
    )
    ax.set_xlabel("day")
    ax.set_ylabel("GPUs")
    ax.set_ylim(0, pool_gpus)
    ax.legend(loc="upper right", fontsize=8)
    out["GPUs by holder"] = _png(fig)

    fig, ax = plt.subplots(figsize=(10, 3.2))
    ax.step(days, [p.rate_rps for p in pts], where="post", label="load (req/s)")
    ax.step(days, [p.capacity_rps for p in pts], where="post", label="serving capacity (req/s)")
    ax.set_xlabel("day")
    ax.legend(loc="upper right", fontsize=8)
    out["Load against capacity"] = _png(fig)

    fig, ax = plt.subplots(figsize=(10, 3.2))
    ax.step(days, [p.lendable_gpus for p in pts], where="post", label="envelope (lendable GPUs)")
    ax.step(days, research, where="post", label="research GPUs")
    ax.set_xlabel("day")
    ax.legend(loc="upper right", fontsize=8)
    out["Lending envelope"] = _png(fig)

    fig, ax = plt.subplots(figsize=(10, 2.6))
    ax.step(days, [p.queued_steps for p in pts], where="post", color="#7a5195")
    ax.set_xlabel("day")
    ax.set_ylabel("waiting steps")
    out["Queue"] = _png(fig)
    return out


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}"
    if isinstance(value, Mapping):
        return ", ".join(f"{html.escape(str(k))}: {_cell(v)}" for k, v in value.items())
    if isinstance(value, list | tuple):
        return ", ".join(html.escape(str(v)) for v in value)
    return html.escape("-" if value is None else str(value))


def render_html(summary: Mapping[str, Any], images: Mapping[str, str]) -> str:
    rows = "\n".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{_cell(v)}</td></tr>" for k, v in summary.items()
    )
    figures = "\n".join(
        f'<figure><figcaption>{html.escape(title)}</figcaption><img alt="{html.escape(title)}" '
        f'src="data:image/png;base64,{data}"></figure>'
        for title, data in images.items()
    )
    title = f"lowtide simulate: {summary.get('policy', '')}, {summary.get('days', '')} days"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2rem; color: #222; max-width: 1100px; }}
table {{ border-collapse: collapse; margin-bottom: 2rem; }}
th, td {{ border-bottom: 1px solid #ddd; padding: .25rem .75rem; text-align: left; font-size: .9rem; }}
th {{ font-weight: 600; color: #444; }}
figure {{ margin: 0 0 1.5rem 0; }} figcaption {{ font-weight: 600; margin-bottom: .25rem; }}
img {{ max-width: 100%; }}
</style></head>
<body><h1>{html.escape(title)}</h1>
<table>{rows}</table>
{figures}
</body></html>
"""
