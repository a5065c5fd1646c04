// Jobs: the queue (position and why each waits), running jobs, history; filters; elapsed time.
import { get, type Job, type JobDetail } from "../api";
import { clear, fmtDuration, fmtTime, h, now, section, stateBadge, table } from "../dom";
import type { PageContext } from "../main";

const STATES = ["", "QUEUED", "RUNNING", "CANCELLING", "SUCCEEDED", "FAILED", "CANCELLED"];
const ACTIVE = new Set(["QUEUED", "RUNNING", "CANCELLING"]);

function elapsed(j: Job): string {
  if (!j.started_at) return `waiting ${fmtDuration(now() - j.submitted_at)}`;
  return fmtDuration((j.finished_at ?? now()) - j.started_at);
}

function stepSummary(j: Job): string {
  return Object.entries(j.steps).map(([k, v]) => `${v} ${k.toLowerCase()}`).join(", ");
}

function jobLink(j: Job): HTMLElement {
  return h("a", { href: `#/job/${encodeURIComponent(j.id)}` }, j.name, h("span", { class: "id" }, ` ${j.id}`));
}

export async function jobsPage(ctx: PageContext): Promise<void> {
  const root = ctx.root;
  const params = new URLSearchParams(sessionStorage.getItem("jobs-filter") ?? "");
  const team = h("input", { id: "f-team", name: "team", value: params.get("team") ?? "", size: 12 });
  const owner = h("input", { id: "f-owner", name: "owner", value: params.get("owner") ?? "", size: 12 });
  const state = h("select", { id: "f-state", name: "state" }, STATES.map((s) => h("option", { value: s, selected: s === (params.get("state") ?? "") }, s || "any")));
  const form = h(
    "form",
    { class: "filters", role: "search", "aria-label": "Filter jobs" },
    h("label", { for: "f-team" }, "Team"), team,
    h("label", { for: "f-owner" }, "User"), owner,
    h("label", { for: "f-state" }, "State"), state,
    h("button", { type: "submit" }, "Filter"),
  );
  const body = h("div", {});
  root.append(h("h1", {}, "Jobs"), form, body);

  async function draw(): Promise<void> {
    const q = new URLSearchParams();
    if (team.value.trim()) q.set("team", team.value.trim());
    if (owner.value.trim()) q.set("owner", owner.value.trim());
    if (state.value) q.append("state", state.value);
    sessionStorage.setItem("jobs-filter", q.toString());
    q.set("limit", "200");
    const { jobs } = await get<{ jobs: Job[] }>(`/v1/jobs?${q.toString()}`);
    const queued = jobs.filter((j) => j.state === "QUEUED").sort((a, b) => b.priority - a.priority || a.submitted_at - b.submitted_at);
    const running = jobs.filter((j) => j.state === "RUNNING" || j.state === "CANCELLING");
    const history = jobs.filter((j) => !ACTIVE.has(j.state));
    const reasons = new Map<string, string>();
    await Promise.all(
      [...queued.slice(0, 25), ...running.slice(0, 25)].map(async (j) => {
        try {
          const d = await get<JobDetail>(`/v1/jobs/${encodeURIComponent(j.id)}`);
          const waiting = d.steps.filter((s) => ["PENDING", "READY", "PREEMPTED"].includes(s.state) && s.reason);
          reasons.set(j.id, waiting.map((s) => `${s.name}: ${s.reason}`).join("; "));
        } catch { /* gone since the list: leave it out */ }
      }),
    );
    clear(body);
    body.append(
      section(`Queue (${queued.length})`,
        queued.length === 0 ? h("p", {}, "Nothing is waiting.") :
        table(["#", "Job", "Team", "User", "Priority", "Waiting", "Why it waits"], queued.map((j, i) => [
          String(i + 1), jobLink(j), j.team, j.owner, String(j.priority), fmtDuration(now() - j.submitted_at), reasons.get(j.id) || j.message || "—",
        ]), "Position: by priority, then submission time")),
      section(`Running (${running.length})`,
        running.length === 0 ? h("p", {}, "Nothing is running.") :
        table(["Job", "State", "Team", "User", "Steps", "Elapsed", "Waiting steps"], running.map((j) => [
          jobLink(j), stateBadge(j.state), j.team, j.owner, stepSummary(j), elapsed(j), reasons.get(j.id) || "—",
        ]))),
      section(`History (${history.length})`,
        history.length === 0 ? h("p", {}, "No finished jobs.") :
        table(["Job", "State", "Team", "User", "Submitted", "Ran for", "Message"], history.map((j) => [
          jobLink(j), stateBadge(j.state), j.team, j.owner, fmtTime(j.submitted_at), elapsed(j), j.message || "—",
        ]))),
    );
  }

  form.addEventListener("submit", (e) => { e.preventDefault(); void draw(); });
  await draw();
  let pending = false;
  ctx.cleanup(ctx.live((kind) => {
    if (kind !== "jobs" || pending) return;
    pending = true;
    window.setTimeout(() => { pending = false; void draw(); }, 300);
  }));
  const timer = window.setInterval(() => void draw(), 30_000); // elapsed times
  ctx.cleanup(() => window.clearInterval(timer));
}
