// Overview: GPUs by holder now, the last 24 h from the ledger, services' load, lending, reclaims.
import { get, type Pool, type Reclaim, type Services, type Timeline } from "../api";
import { clear, fmtDuration, fmtTime, h, now, section, table } from "../dom";
import type { PageContext } from "../main";
import { lineChart } from "./chart";

const HOLDER_LABEL: Record<string, string> = { idle: "free", attempt: "research", replica: "serving" };

export function poolGrid(pool: Pool): HTMLElement {
  return h(
    "div",
    { class: "pool" },
    pool.nodes.map((n) =>
      h(
        "div",
        { class: "node" },
        h("div", { class: "node-name" }, `${n.name} · ${n.free} free`),
        h(
          "ul",
          { class: "gpus", "aria-label": `GPUs of ${n.name}` },
          n.gpus.map((g) => {
            const who = g.holder === "attempt" ? `${g.job_id ?? ""} ${g.step ?? ""} (${g.team ?? "?"})` : HOLDER_LABEL[g.holder] ?? g.holder;
            const label = `GPU ${g.index}: ${who}, since ${fmtTime(g.since)}`;
            const inner = g.job_id ? h("a", { href: `#/job/${encodeURIComponent(g.job_id)}`, "aria-label": label, title: label }, String(g.index)) : h("span", { title: label, "aria-label": label }, String(g.index));
            return h("li", { class: `gpu h-${g.holder}` }, inner);
          }),
        ),
      ),
    ),
    h("p", { class: "legend" }, ["idle", "attempt", "replica"].map((k) => h("span", { class: `key h-${k}` }, HOLDER_LABEL[k]))),
  );
}

export async function overviewPage(ctx: PageContext): Promise<void> {
  const root = ctx.root;
  root.appendChild(h("h1", {}, "Overview"));
  const nowBox = h("div", {});
  const timelineBox = h("div", { class: "chart" });
  const servicesBox = h("div", {});
  const lendingBox = h("div", {});
  const reclaimBox = h("div", {});
  root.append(
    section("GPUs now", nowBox),
    section("Last 24 hours", h("p", { class: "hint" }, "GPU-equivalents by holder, from the GPU ledger (30-minute buckets); parked: GPUs of replicas parked or asleep that research was not using; lent, idle: GPUs inside the lending envelope that no research used; free: GPUs inference kept back (reserve, headroom) or no envelope covered."), timelineBox),
    h("div", { class: "cols" }, section("Services", servicesBox), section("Lending", lendingBox)),
    section("Reclaims in progress", reclaimBox),
  );

  async function drawNow(): Promise<void> {
    const [pool, services, reclaims] = await Promise.all([
      get<Pool>("/v1/pool"),
      get<Services>("/v1/services"),
      get<Reclaim[]>("/v1/reclaims?state=OPEN"),
    ]);
    clear(nowBox);
    const held = (k: string) => pool.nodes.reduce((a, n) => a + n.gpus.filter((g) => g.holder === k).length, 0);
    nowBox.append(
      h("p", { class: "stats" },
        h("strong", {}, String(pool.total)), " GPUs: ",
        h("span", { class: "key h-replica" }, `${held("replica")} serving`), " ",
        h("span", { class: "key h-attempt" }, `${held("attempt")} research`), " ",
        h("span", { class: "key h-idle" }, `${pool.free} free`)),
      poolGrid(pool),
    );
    clear(servicesBox);
    servicesBox.append(
      services.services.length === 0
        ? h("p", {}, "No inference services are configured.")
        : table(
            ["Service", "Replicas serving", "Target", "Load", "Reason"],
            services.services.map((s) => {
              const serving = s.replicas.filter((r) => r.state === "SERVING").length;
              const running = s.signals.reduce((a, x) => a + (x.running ?? 0), 0);
              const waiting = s.signals.reduce((a, x) => a + (x.waiting ?? 0), 0);
              const cap = Math.max(1, s.target);
              return [
                h("a", { href: "#/services" }, s.name),
                String(serving),
                `${s.target} (min ${s.min_replicas}, max ${s.max_replicas})`,
                h("span", {}, h("meter", { min: 0, max: cap, value: Math.min(serving, cap), "aria-label": `${s.name}: ${serving} of ${cap} replicas serving` }), ` ${running} running, ${waiting} waiting`),
                s.reason || "—",
              ];
            }),
          ),
    );
    clear(lendingBox);
    const l = services.lending;
    lendingBox.append(
      l === null
        ? h("p", {}, "No lending envelope: every GPU is for research.")
        : h("dl", { class: "kv" },
            h("dt", {}, "Mode"), h("dd", {}, l.mode),
            h("dt", {}, "Lendable GPUs"), h("dd", {}, String(l.lendable_gpus)),
            h("dt", {}, "Inference claim"), h("dd", {}, String(l.inference_claim_gpus)),
            h("dt", {}, "Reserve"), h("dd", {}, String(l.reserve_gpus)),
            h("dt", {}, "Lending open"), h("dd", {}, l.lending_open ? "yes" : "no"),
            h("dt", {}, "Return by"), h("dd", {}, fmtTime(l.return_by)),
            h("dt", {}, "Fail safe"), h("dd", {}, l.fail_safe ?? "—"),
            h("dt", {}, "Reasons"), h("dd", {}, l.reasons.join("; ") || "—")),
    );
    clear(reclaimBox);
    reclaimBox.append(
      reclaims.length === 0
        ? h("p", {}, "None: no service is taking GPUs back right now.")
        : table(
            ["Reclaim", "Service", "GPUs", "Detected", "Victims chosen", "Notice sent", "GPUs freed", "Replica healthy", "Elapsed"],
            reclaims.map((r) => [
              `#${r.id}`, r.service ?? "—", String(r.gpus), fmtTime(r.detected_at), fmtTime(r.decided_at),
              fmtTime(r.notice_at), fmtTime(r.freed_at),
              r.service === null ? "n/a: lending shrank, no replica waits" : fmtTime(r.healthy_at),
              fmtDuration(now() - r.detected_at),
            ]),
          ),
    );
  }

  async function drawTimeline(): Promise<void> {
    const t = await get<Timeline>("/v1/pool/timeline?hours=24&buckets=48");
    clear(timelineBox);
    const xs = t.buckets.map((b) => b.end);
    lineChart(timelineBox, `GPUs by holder (capacity ${t.capacity})`, xs, [
      { label: "serving", color: "#2b6cb0", values: t.buckets.map((b) => b.serving) },
      { label: "research", color: "#2f855a", values: t.buckets.map((b) => b.research) },
      { label: "parked / sleeping", color: "#805ad5", values: t.buckets.map((b) => b.parked) },
      { label: "lent, idle", color: "#d69e2e", values: t.buckets.map((b) => b.lent_idle) },
      { label: "free", color: "#a0aec0", values: t.buckets.map((b) => b.free) },
    ], { stacked: true, yLabel: "GPUs" });
    const last = t.buckets[t.buckets.length - 1];
    if (last) {
      timelineBox.append(h("p", { class: "hint" },
        `Last 30 minutes: ${last.serving} serving, ${last.research} research (lent and used), `
        + `${last.parked} parked or sleeping, ${last.lent_idle} lent and idle, ${last.free} free.`));
    }
  }

  await Promise.all([drawNow(), drawTimeline()]);
  ctx.cleanup(ctx.live((kind) => { if (kind === "pool") void drawNow(); }));
  const timer = window.setInterval(() => void drawTimeline(), 60_000);
  ctx.cleanup(() => window.clearInterval(timer));
}
