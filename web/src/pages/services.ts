// Services: replicas by state, desired vs actual with the last decision's reasons, and charts of
// each service's load over the last hour (kept by the control plane since it started).
import { get, type Services } from "../api";
import { clear, fmtTime, h, section, stateBadge, table } from "../dom";
import type { PageContext } from "../main";
import { lineChart } from "./chart";

export async function servicesPage(ctx: PageContext): Promise<void> {
  const root = ctx.root;
  root.appendChild(h("h1", {}, "Services"));
  const body = h("div", {});
  root.appendChild(body);

  async function draw(): Promise<void> {
    const data = await get<Services>("/v1/services");
    clear(body);
    if (data.services.length === 0) {
      body.appendChild(h("p", {}, "No inference services are configured (see services: in lowtide.yaml)."));
      return;
    }
    for (const sv of data.services) {
      const counts: Record<string, number> = {};
      for (const r of sv.replicas) counts[r.state] = (counts[r.state] ?? 0) + 1;
      const samples = sv.load_history ?? [];
      const chart = h("div", { class: "chart" });
      body.appendChild(section(
        `${sv.name}`,
        h("p", { class: "meta" }, `model ${sv.model} · ${sv.gpus_per_replica} GPU(s) per replica · park: ${sv.park}`),
        h("dl", { class: "kv" },
          h("dt", {}, "Replicas"), h("dd", {}, Object.entries(counts).map(([k, v]) => `${v} ${k.toLowerCase()}`).join(", ") || "none"),
          h("dt", {}, "Desired / target"), h("dd", {}, `${sv.desired ?? "?"} desired (needed ${sv.needed ?? "?"}), target ${sv.target}, actual ${counts["SERVING"] ?? 0} serving`),
          h("dt", {}, "Last decision"), h("dd", {}, sv.reason || "—"),
          h("dt", {}, "Per signal"), h("dd", {}, Object.entries(sv.per_signal).map(([k, v]) => `${k}: ${v ?? "?"}`).join(", ") || "—"),
          sv.guard ? [h("dt", {}, "Guard"), h("dd", {}, sv.guard)] : null,
          sv.blocked ? [h("dt", {}, "Blocked"), h("dd", {}, sv.blocked)] : null,
          sv.alert ? [h("dt", {}, "Alert"), h("dd", { class: "error" }, sv.alert)] : null,
        ),
        table(["Replica", "State", "Where", "Since", "Failures", "Message"], sv.replicas.map((r) => [
          r.id, stateBadge(r.state), r.node ? `${r.node} [${r.gpus.join(",")}]` : "—", fmtTime(r.since), String(r.failures), r.message || "—",
        ])),
        chart,
      ));
      if (samples.length > 1) {
        lineChart(chart, `${sv.name}: load over the last hour`, samples.map((x) => x.at), [
          { label: "requests running", color: "#2b6cb0", values: samples.map((x) => x.running) },
          { label: "requests waiting", color: "#c05621", values: samples.map((x) => x.waiting) },
          { label: "replicas desired", color: "#2f855a", values: samples.map((x) => x.desired ?? 0) },
        ], { height: 180 });
      } else {
        chart.appendChild(h("p", { class: "hint" }, "The load chart fills in as the control plane reads the load (a sample every 5 s)."));
      }
    }
  }
  await draw();
  const timer = window.setInterval(() => void draw(), 5000);
  ctx.cleanup(() => window.clearInterval(timer));
}
