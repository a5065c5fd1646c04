// Submit: a YAML editor (textarea with line numbers) that starts from the templates and shows
// the API's validation errors located on their lines (POST /v1/jobs/validate) as you type.
import { LineCounter, parseDocument, isNode } from "yaml";
import { ApiFailure, get, postYaml, type ErrorItem, type Job, type Template } from "../api";
import { clear, h } from "../dom";
import type { PageContext } from "../main";

/** The 1-based line a located API error (`steps[0].gpus`, `body.team`) points at, if found. */
export function lineOf(text: string, loc: string): number | null {
  const path: (string | number)[] = [];
  for (const part of loc.replace(/^(body|spec)\.?/, "").split(".")) {
    const m = part.match(/^([^[\]]*)((?:\[\d+\])*)$/);
    if (!m) return null;
    if (m[1]) path.push(m[1]);
    for (const idx of m[2].matchAll(/\[(\d+)\]/g)) path.push(Number(idx[1]));
  }
  const counter = new LineCounter();
  const doc = parseDocument(text, { lineCounter: counter, keepSourceTokens: false });
  for (let n = path.length; n > 0; n--) {
    const node = doc.getIn(path.slice(0, n), true);
    if (isNode(node) && node.range) {
      // point at the key of a mapping value when there is one: the line the user reads
      const parent = n > 1 ? doc.getIn(path.slice(0, n - 1), true) : doc.contents;
      const key = path[n - 1];
      if (typeof key === "string" && parent && typeof parent === "object" && "items" in parent) {
        const pair = (parent as { items: { key: unknown }[] }).items.find((p) => isNode(p.key) && (p.key as { value?: unknown }).value === key);
        if (pair && isNode(pair.key) && pair.key.range) return counter.linePos(pair.key.range[0]).line;
      }
      return counter.linePos(node.range[0]).line;
    }
  }
  return null;
}

export async function submitPage(ctx: PageContext): Promise<void> {
  const root = ctx.root;
  root.appendChild(h("h1", {}, "Submit a job"));
  if (ctx.session.role === "viewer") {
    root.appendChild(h("p", {}, "A viewer token reads only; ask for a user token to submit jobs."));
    return;
  }
  const templates = await get<Template[]>("/v1/templates");
  const draft = sessionStorage.getItem("submit-draft");
  sessionStorage.removeItem("submit-draft");
  const gutter = h("pre", { class: "gutter", "aria-hidden": "true" });
  const editor = h("textarea", { id: "spec", name: "spec", spellcheck: "false", rows: 22, "aria-describedby": "spec-status spec-errors", autocapitalize: "off" });
  editor.value = draft ?? templates[0]?.starter ?? "name: my-job\nsteps:\n  - name: main\n    command: [python, -c, \"print('hello')\"]\n    gpus: 0\n";
  const status = h("p", { id: "spec-status", role: "status", class: "hint" });
  const errors = h("ul", { id: "spec-errors", class: "errors", "aria-live": "polite" });
  const submitBtn = h("button", { type: "submit", class: "primary" }, "Submit");
  const result = h("p", { role: "alert", class: "error" });
  const picker = h(
    "div",
    { class: "templates", role: "group", "aria-label": "Start from a template" },
    h("span", {}, "Start from: "),
    templates.map((t) => h("button", { type: "button", "data-template": t.name, onclick: () => { editor.value = t.starter; update(); } }, t.name)),
    h("button", { type: "button", onclick: () => { editor.value = "name: my-job\nteam: " + (ctx.session.teams[0] && ctx.session.teams[0] !== "*" ? ctx.session.teams[0] : "default") + "\nsteps:\n  - name: main\n    command: [python, -c, \"print('hello')\"]\n    gpus: 0\n"; update(); } }, "blank"),
  );
  const form = h(
    "form",
    { class: "submit", "aria-label": "Job spec" },
    picker,
    h("label", { for: "spec" }, "Job spec (YAML)"),
    h("div", { class: "editor" }, gutter, editor),
    status,
    errors,
    h("div", { class: "actions" }, submitBtn),
    result,
  );
  root.appendChild(form);

  let badLines = new Set<number>();
  function drawGutter(): void {
    const n = editor.value.split("\n").length;
    clear(gutter);
    for (let i = 1; i <= n; i++) gutter.appendChild(h("span", { class: badLines.has(i) ? "bad" : "" }, String(i) + "\n"));
    gutter.scrollTop = editor.scrollTop;
  }
  editor.addEventListener("scroll", () => { gutter.scrollTop = editor.scrollTop; });

  function showErrors(items: ErrorItem[]): void {
    clear(errors);
    badLines = new Set();
    for (const e of items) {
      let line: number | null = null;
      try { line = lineOf(editor.value, e.loc); } catch { line = null; }
      if (line !== null) badLines.add(line);
      const jump = line !== null
        ? h("button", { type: "button", class: "link", onclick: () => goToLine(line!) }, `line ${line}`)
        : h("span", {}, "—");
      errors.appendChild(h("li", { class: "error-item", "data-line": line ?? "" }, jump, ": ", h("code", {}, e.loc), ` ${e.msg}`));
    }
    drawGutter();
  }

  function goToLine(line: number): void {
    const lines = editor.value.split("\n");
    const start = lines.slice(0, line - 1).reduce((a, l) => a + l.length + 1, 0);
    editor.focus();
    editor.setSelectionRange(start, start + (lines[line - 1]?.length ?? 0));
  }

  let seq = 0;
  let timer = 0;
  async function validate(): Promise<boolean> {
    const mine = ++seq;
    status.textContent = "Checking…";
    try {
      const out = await postYaml<{ valid: boolean; warnings: ErrorItem[] }>("/v1/jobs/validate", editor.value);
      if (mine !== seq) return false;
      status.textContent = out.warnings.length ? `Valid, with ${out.warnings.length} warning(s).` : "Valid.";
      showErrors(out.warnings);
      return true;
    } catch (err) {
      if (mine !== seq) return false;
      if (err instanceof ApiFailure) {
        status.textContent = err.message;
        showErrors(err.errors);
      } else {
        status.textContent = String(err);
      }
      return false;
    }
  }
  function update(): void {
    drawGutter();
    window.clearTimeout(timer);
    timer = window.setTimeout(() => void validate(), 350);
  }
  editor.addEventListener("input", update);
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    result.textContent = "";
    submitBtn.disabled = true;
    try {
      const job = await postYaml<Job>("/v1/jobs", editor.value);
      location.hash = `#/job/${encodeURIComponent(job.id)}`;
    } catch (err) {
      if (err instanceof ApiFailure) { result.textContent = `Not submitted: ${err.message}`; showErrors(err.errors); }
      else result.textContent = String(err);
    } finally {
      submitBtn.disabled = false;
    }
  });
  ctx.cleanup(() => window.clearTimeout(timer));
  drawGutter();
  void validate();
}
