// Job detail: the DAG with step states, attempts (preemptions, lost work), checkpoints, events,
// parameters and the reproducibility record, a live log tail; cancel, retry from the failed steps, rerun.
import dagre from "dagre";
import { ApiFailure, call, get, logText, postYaml, type Attempt, type Job, type JobDetail, type Step } from "../api";
import { append, clear, fmtDuration, fmtTime, h, now, s, section, stateBadge, table } from "../dom";
import type { PageContext } from "../main";

const COLORS: Record<string, string> = {
  PENDING: "#e2e8f0", READY: "#fefcbf", RUNNING: "#bee3f8", PREEMPTING: "#fbd38d", PREEMPTED: "#fbd38d",
  CANCELLING: "#fed7d7", SUCCEEDED: "#c6f6d5", FAILED: "#feb2b2", CANCELLED: "#e2e8f0", SKIPPED: "#edf2f7",
};

export function drawDag(steps: Step[]): SVGElement {
  const g = new dagre.graphlib.Graph();
  g.setGraph({ rankdir: "LR", nodesep: 24, ranksep: 48, marginx: 8, marginy: 8 });
  g.setDefaultEdgeLabel(() => ({}));
  const label = (st: Step) => st.state + (st.preemptions ? ` · ${st.preemptions} preempted` : "");
  for (const st of steps) g.setNode(st.name, { width: Math.max(120, st.name.length * 9 + 24, label(st).length * 7 + 20), height: 46 });
  for (const st of steps) for (const d of st.depends) g.setEdge(d, st.name);
  dagre.layout(g);
  const graph = g.graph();
  const width = (graph.width ?? 200) + 16;
  const height = (graph.height ?? 60) + 16;
  const svg = s("svg", { viewBox: `0 0 ${width} ${height}`, width, height, role: "img", class: "dag" });
  svg.appendChild(s("title", {}, `Steps: ${steps.map((x) => `${x.name} ${x.state}`).join(", ")}`));
  const defs = s("defs", {}, s("marker", { id: "arrow", viewBox: "0 0 10 10", refX: 10, refY: 5, markerWidth: 8, markerHeight: 8, orient: "auto" }, s("path", { d: "M0,0 L10,5 L0,10 z", fill: "#4a5568" })));
  svg.appendChild(defs);
  for (const e of g.edges()) {
    const pts = g.edge(e).points;
    svg.appendChild(s("path", { d: "M" + pts.map((p) => `${p.x},${p.y}`).join(" L"), fill: "none", stroke: "#4a5568", "marker-end": "url(#arrow)" }));
  }
  for (const st of steps) {
    const n = g.node(st.name);
    const grp = s("g", { transform: `translate(${n.x - n.width / 2},${n.y - n.height / 2})`, class: "dag-node", "data-step": st.name, "data-state": st.state });
    grp.appendChild(s("rect", { width: n.width, height: n.height, rx: 6, fill: COLORS[st.state] ?? "#fff", stroke: "#2d3748" }));
    grp.appendChild(s("text", { x: n.width / 2, y: 19, "text-anchor": "middle", "font-weight": "bold" }, st.name));
    grp.appendChild(s("text", { x: n.width / 2, y: 36, "text-anchor": "middle", "font-size": 11 }, label(st)));
    svg.appendChild(grp);
  }
  return svg;
}

function attemptRows(attempts: Attempt[]): HTMLElement[][] {
  return attempts.map((a) => [
    a.step, String(a.number), stateBadge(a.state), `${a.node} [${a.gpus.join(",")}]`, fmtTime(a.started_at),
    a.ended_at ? fmtDuration(a.ended_at - a.started_at) : `${fmtDuration(now() - a.started_at)} so far`,
    a.preempted ? h("strong", { class: "preempted" }, "preempted") : a.stop_reason ?? "—",
    a.exit_code !== null ? `exit ${a.exit_code}` : a.signal !== null ? `signal ${a.signal}` : "—",
    a.lost_gpu_seconds !== null ? `${(a.lost_gpu_seconds / 3600).toFixed(3)} GPU-h` : "—",
  ].map((x) => (typeof x === "string" ? h("span", {}, x) : x)));
}

export async function jobPage(ctx: PageContext, jobId: string): Promise<void> {
  const root = ctx.root;
  const head = h("div", {});
  const dagBox = h("div", { class: "dag-box" });
  const stepsBox = h("div", {});
  const attemptsBox = h("div", {});
  const cpBox = h("div", {});
  const eventsBox = h("div", {});
  const paramsBox = h("div", {});
  const recordBox = h("div", {});
  const actionsBox = h("div", {});
  let shownState = "";
  const stepSel = h("select", { id: "log-step" });
  const logPre = h("pre", { class: "log", id: "log", tabindex: "0", "aria-label": "log output" });
  const logNote = h("p", { class: "hint", role: "status" });
  root.append(
    head,
    actionsBox,
    section("Steps", dagBox, stepsBox),
    section("Attempts", h("p", { class: "hint" }, "Every run of a step: preemptions, checkpoints resumed from, GPU time lost since the last checkpoint."), attemptsBox),
    section("Logs", h("label", { for: "log-step" }, "Log of step "), stepSel, logNote, logPre),
    h("div", { class: "cols" }, section("Checkpoints", cpBox), section("Parameters and record", paramsBox, recordBox)),
    section("Events", eventsBox),
  );
  let detail: JobDetail | null = null;

  async function action(label: string, fn: () => Promise<Job | void>, msg: HTMLElement): Promise<void> {
    msg.textContent = "";
    try {
      const job = await fn();
      if (job && job.id !== jobId) location.hash = `#/job/${encodeURIComponent(job.id)}`;
      else await draw();
    } catch (err) {
      msg.textContent = `${label} failed: ${err instanceof ApiFailure ? err.message : String(err)}`;
    }
  }

  /** Submit the job's own spec again with changed parameters (`?param=k=v`, like `lowtide submit -p`). */
  function rerunForm(d: JobDetail, params: Record<string, unknown>): HTMLElement {
    const inputs = Object.entries(params).map(([k, v]) => {
      const id = `rp-${k}`;
      const input = h("input", { id, name: k, value: typeof v === "string" ? v : JSON.stringify(v), size: 16 });
      return { k, input, row: h("div", { class: "param-row" }, h("label", { for: id }, k), input) };
    });
    const msg = h("p", { class: "error", role: "alert" });
    const form = h("form", { class: "rerun", "aria-label": "Rerun with changed parameters" },
      h("h3", {}, "Rerun with changed parameters"), inputs.map((x) => x.row),
      h("button", { type: "submit" }, "Submit with these parameters"), msg);
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      const q = new URLSearchParams();
      for (const { k, input } of inputs) q.append("param", `${k}=${input.value}`);
      void action("Rerun", () => postYaml<Job>(`/v1/jobs?${q.toString()}`, d.source_text), msg);
    });
    return form;
  }

  async function draw(): Promise<void> {
    const d = await get<JobDetail>(`/v1/jobs/${encodeURIComponent(jobId)}`);
    detail = d;
    const j = d.job;
    const msg = h("p", { class: "error", role: "alert" });
    const mayAct = ctx.session.role === "admin" || (ctx.session.role === "user");
    const active = ["QUEUED", "RUNNING", "CANCELLING"].includes(j.state);
    const retriable = ["FAILED", "CANCELLED"].includes(j.state);  // POST /v1/jobs/{id}/retry (policy.retry)
    clear(head);
    append(head, [
      h("h1", {}, `${j.name} `, h("span", { class: "id" }, j.id), " ", stateBadge(j.state)),
      h("p", { class: "meta" },
        `team ${j.team} · by ${j.owner} · priority ${j.priority} · submitted ${fmtTime(j.submitted_at)} · `,
        j.started_at ? `elapsed ${fmtDuration((j.finished_at ?? now()) - j.started_at)}` : `waiting ${fmtDuration(now() - j.submitted_at)}`,
        j.rerun_of ? h("span", {}, " · rerun of ", h("a", { href: `#/job/${encodeURIComponent(j.rerun_of)}` }, j.rerun_of)) : null),
      j.message ? h("p", {}, j.message) : null,
    ]);
    if (j.state !== shownState) {  // buttons keep focus across live redraws unless the state changes
      shownState = j.state;
      clear(actionsBox);
      append(actionsBox, [
      mayAct ? h("div", { class: "actions" },
        active && (ctx.session.role === "admin" || j.owner === ctx.session.name)
          ? h("button", { type: "button", class: "danger", onclick: () => {
              if (window.confirm(`Cancel job ${j.name} (${j.id})?`)) void action("Cancel", () => call<Job>("POST", `/v1/jobs/${encodeURIComponent(jobId)}/cancel`), msg);
            } }, "Cancel job")
          : null,
        retriable && (ctx.session.role === "admin" || j.owner === ctx.session.name)
          ? h("button", { type: "button", class: "retry", title: "Run the failed, cancelled and skipped steps again in this job; succeeded steps are kept",
              onclick: () => void action("Retry", async () => { await call<unknown>("POST", `/v1/jobs/${encodeURIComponent(jobId)}/retry`); }, msg) },
              "Retry from failed steps")
          : null,
        h("button", { type: "button", onclick: () => void action("Rerun", () => call<Job>("POST", `/v1/jobs/${encodeURIComponent(jobId)}/rerun`), msg) }, "Rerun"),
        h("button", { type: "button", onclick: () => {
          sessionStorage.setItem("submit-draft", d.source_text);
          location.hash = "#/submit";
        } }, "Edit and resubmit…"),
      ) : null,
      msg,
      ]);
    }
    clear(dagBox);
    dagBox.append(drawDag(d.steps));
    clear(stepsBox);
    stepsBox.append(table(["Step", "State", "GPUs", "Why / status", "Retries", "Preemptions", "Last checkpoint"], d.steps.map((st) => [
      st.name, stateBadge(st.state), String(st.gpus), st.reason || "—", `${st.retries_used}/${st.max_retries}`,
      String(st.preemptions), st.last_checkpoint ? `${st.last_checkpoint} (${fmtTime(st.last_checkpoint_at)})` : "—",
    ])));
    clear(attemptsBox);
    const preemptions = d.attempts.filter((a) => a.preempted).length;
    const lost = d.attempts.reduce((a, x) => a + (x.lost_gpu_seconds ?? 0), 0);
    attemptsBox.append(
      h("p", { class: "stats" }, `${d.attempts.length} attempts · `, h("strong", {}, `${preemptions} preemptions`), ` · ${(lost / 3600).toFixed(3)} GPU-hours lost`),
      d.attempts.length ? table(["Step", "#", "State", "Where", "Started", "Ran", "Stopped because", "Exit", "Lost"], attemptRows(d.attempts)) : h("p", {}, "No attempt yet."),
    );
    clear(cpBox);
    cpBox.append(d.checkpoints.length
      ? table(["Step", "Attempt", "Label", "Progress", "Reported"], d.checkpoints.map((c) => [c.step, String(c.attempt_id), c.label, c.progress ?? "—", fmtTime(c.reported_at)]))
      : h("p", {}, "No checkpoints reported."));
    const params = (d.spec.params ?? {}) as Record<string, unknown>;
    const last = d.attempts[d.attempts.length - 1];
    clear(recordBox);
    append(recordBox, [
      last ? h("details", {}, h("summary", {}, `Reproducibility record (attempt ${last.step} #${last.number})`), h("pre", { class: "record" }, JSON.stringify(last.record, null, 2))) : null,
    ]);
    if (!paramsBox.firstChild) append(paramsBox, [
      Object.keys(params).length ? table(["Parameter", "Value"], Object.entries(params).map(([k, v]) => [k, JSON.stringify(v)])) : h("p", {}, "No parameters."),
      mayAct && Object.keys(params).length ? rerunForm(d, params) : null,
      h("details", {}, h("summary", {}, "Submitted spec"), h("pre", { class: "record" }, d.source_text)),
    ]);
    clear(eventsBox);
    eventsBox.append(d.events.length
      ? table(["When", "Step", "Kind", "Message"], d.events.slice(-100).reverse().map((e) => [fmtTime(e.at), e.step ?? "—", e.kind, e.message]))
      : h("p", {}, "No events."));
    const names = d.steps.map((x) => x.name);
    if (stepSel.options.length !== names.length) {
      const chosen = stepSel.value;
      clear(stepSel);
      stepSel.append(...names.map((n) => h("option", { value: n, selected: n === chosen }, n)));
      if (!chosen) {
        const running = d.steps.find((x) => x.state === "RUNNING") ?? d.steps.find((x) => d.attempts.some((a) => a.step === x.name));
        if (running) stepSel.value = running.name;
      }
    }
  }

  // Live log tail of the chosen step's latest attempt (restarts on a new attempt).
  let logStep = "";
  let logAttempt = 0;
  let offset = 0;
  let tailing = false;
  async function tail(): Promise<void> {
    if (tailing) return; // one read at a time: two at one offset would print the same bytes twice
    tailing = true;
    try {
      await tailOnce();
    } finally {
      tailing = false;
    }
  }
  async function tailOnce(): Promise<void> {
    if (!detail) return;
    const step = stepSel.value;
    const attempts = detail.attempts.filter((a) => a.step === step);
    const latest = attempts[attempts.length - 1];
    if (step !== logStep || (latest && latest.number !== logAttempt)) {
      logStep = step;
      logAttempt = latest?.number ?? 0;
      offset = 0;
      logPre.textContent = "";
    }
    if (!latest) {
      logNote.textContent = `Step ${step} has not started yet; its log appears here when it does.`;
      return;
    }
    logNote.textContent = `Attempt ${latest.number} (${latest.state})`;
    const text = await logText(jobId, step, offset);
    if (text && step === logStep && latest.number === logAttempt) {
      offset += new TextEncoder().encode(text).length;
      const atBottom = logPre.scrollTop + logPre.clientHeight >= logPre.scrollHeight - 4;
      logPre.appendChild(document.createTextNode(text));
      if (atBottom) logPre.scrollTop = logPre.scrollHeight;
    }
  }
  stepSel.addEventListener("change", () => void tail());

  await draw();
  await tail();
  const timer = window.setInterval(() => void tail(), 1000);
  ctx.cleanup(() => window.clearInterval(timer));
  ctx.cleanup(ctx.live((kind, data) => {
    if (kind === "jobs" && data.changed?.includes(jobId)) void draw();
  }));
  const slow = window.setInterval(() => void draw(), 10_000); // checkpoints and events change no state
  ctx.cleanup(() => window.clearInterval(slow));
}
