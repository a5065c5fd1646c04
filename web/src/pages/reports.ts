// Reports: a month's research GPU-hours per team against the month before, savings, preemption
// losses; CSV export of the table (built in the browser from the same figures); and the simulator's
// reports (`lowtide simulate --out <api.simulation_reports_dir>/NAME`) when there are any.
import { ApiFailure, get, type Monthly, type MonthlyRow, type SimulationReport } from "../api";
import { clear, fmtTime, h, section, table } from "../dom";
import type { PageContext } from "../main";

const COLUMNS: [string, (r: MonthlyRow) => string][] = [
  ["team", (r) => r.key],
  ["jobs_run", (r) => String(r.jobs_run)],
  ["research_gpu_hours", (r) => r.research_gpu_hours.toFixed(2)],
  ["previous_research_gpu_hours", (r) => r.previous_research_gpu_hours.toFixed(2)],
  ["change_pct", (r) => (r.change_pct === null ? "" : r.change_pct.toFixed(1))],
  ["equivalent_gpus", (r) => r.equivalent_gpus.toFixed(2)],
  ["savings", (r) => r.savings.toFixed(2)],
  ["preemptions", (r) => String(r.preemptions)],
  ["lost_gpu_hours", (r) => r.lost_gpu_hours.toFixed(3)],
];

export function toCsv(rows: MonthlyRow[]): string {
  const esc = (v: string) => (/[",\n]/.test(v) ? `"${v.replace(/"/g, '""')}"` : v);
  return [COLUMNS.map((c) => c[0]).join(","), ...rows.map((r) => COLUMNS.map(([, f]) => esc(f(r))).join(","))].join("\n") + "\n";
}

export async function reportsPage(ctx: PageContext): Promise<void> {
  const root = ctx.root;
  const d = new Date();
  const month = h("input", { id: "month", type: "month", value: `${d.getFullYear()}-${String(d.getMonth() + 1).padStart(2, "0")}` });
  const form = h("form", { class: "filters", "aria-label": "Report month" }, h("label", { for: "month" }, "Month"), month, h("button", { type: "submit" }, "Show"));
  const body = h("div", {});
  root.append(h("h1", {}, "Reports"), form, body);

  async function draw(): Promise<void> {
    clear(body);
    let rep: Monthly;
    try {
      rep = await get<Monthly>(`/v1/reports/monthly?month=${encodeURIComponent(month.value)}`);
    } catch (err) {
      body.appendChild(h("p", { class: "error", role: "alert" }, err instanceof ApiFailure ? err.message : String(err)));
      return;
    }
    const rows = [...rep.teams, rep.total];
    const csv = toCsv(rows);
    const link = h("a", { href: URL.createObjectURL(new Blob([csv], { type: "text/csv" })), download: `lowtide-${rep.month}.csv`, class: "button" }, "Export CSV");
    ctx.cleanup(() => URL.revokeObjectURL(link.href));
    body.append(
      section(`${rep.month}${rep.complete ? "" : " (so far)"} against ${rep.previous_month}`,
        h("p", { class: "stats" },
          `Capacity ${rep.capacity_gpu_hours.toFixed(1)} GPU-h · lent ${rep.lent_gpu_hours.toFixed(1)} GPU-h (${rep.lent_gpus.toFixed(2)} GPUs) · `,
          h("strong", {}, `research ${rep.total.research_gpu_hours.toFixed(1)} GPU-h = ${rep.total.equivalent_gpus.toFixed(2)} GPUs`),
          ` · savings ${rep.total.savings.toFixed(2)} ${rep.currency} at ${rep.price_per_gpu_hour} ${rep.currency}/GPU-h`,
          ` · ${rep.total.preemptions} preemptions, ${rep.total.lost_gpu_hours.toFixed(2)} GPU-h lost`),
        table(["Team", "Jobs", "Research GPU-h", "Previous", "Change", "Equivalent GPUs", `Savings (${rep.currency})`, "Preemptions", "Lost GPU-h"],
          rows.map((r) => COLUMNS.map(([name, f]) => (name === "change_pct" && f(r) ? `${f(r)} %` : f(r) || "—"))),
          `Times in ${rep.timezone}`),
        link),
    );
  }
  form.addEventListener("submit", (e) => { e.preventDefault(); void draw(); });
  const sims = h("div", {});
  root.append(section("Simulator reports", sims));
  await Promise.all([draw(), drawSimulations(sims)]);
}

const num = (v: number | null | undefined, digits: number): string => (v === null || v === undefined ? "—" : v.toFixed(digits));

async function drawSimulations(box: HTMLElement): Promise<void> {
  let list: { reports: SimulationReport[] };
  try {
    list = await get<{ reports: SimulationReport[] }>("/v1/reports/simulations");
  } catch (err) {
    box.appendChild(h("p", { class: "error", role: "alert" }, err instanceof ApiFailure ? err.message : String(err)));
    return;
  }
  if (list.reports.length === 0) {
    box.appendChild(h("p", {}, "No simulator report yet. Run ", h("code", {}, "lowtide simulate … --out DIR/NAME"),
      " with DIR the server's simulation reports directory (api.simulation_reports_dir; default STATE_DIR/simulations)."));
    return;
  }
  const rows = list.reports.flatMap((r) =>
    r.error !== null
      ? [[r.name, "—", h("span", { class: "error" }, `unreadable: ${r.error}`), "", "", "", "", "", "", fmtTime(r.modified_at)]]
      : r.runs.map((run) => {
          const f = run.figures;
          return [
            r.name,
            run.policy,
            num(f.days, 2),
            num(f.gpu_hours_harvested, 1),
            f.harvest_efficiency === null || f.harvest_efficiency === undefined ? "—" : `${(f.harvest_efficiency * 100).toFixed(1)} %`,
            num(f.preemptions, 0),
            num(f.slo_violation_minutes, 1),
            `${num(f.reclaim_latency_p50_s, 1)} / ${num(f.reclaim_latency_p99_s, 1)}`,
            f.savings === null || f.savings === undefined ? "—" : `${f.savings.toFixed(2)} ${run.currency ?? ""}`.trim(),
            fmtTime(r.modified_at),
          ];
        }),
  );
  box.appendChild(table(
    ["Report", "Policy", "Days", "Harvested GPU-h", "Harvest efficiency", "Preemptions", "SLO violation (min)", "Reclaim p50 / p99 (s)", "Savings", "Written"],
    rows, "One row per simulated policy; figures from each report's summary.json or compare.json"));
}
