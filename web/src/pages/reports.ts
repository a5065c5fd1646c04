// Reports: a month's research GPU-hours per team against the month before, savings, preemption
// losses; CSV export of the table (built in the browser from the same figures).
import { ApiFailure, get, type Monthly, type MonthlyRow } from "../api";
import { clear, h, section, table } from "../dom";
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
  await draw();
}
