// The lowtide dashboard: a hash router over pages that each call the API and draw with DOM nodes.
import "./style.css";
import { ApiFailure, get, call, postJson, setCsrf, setLoggedOutHandler, type Session } from "./api";
import { clear, h } from "./dom";
import { onLive, startLive, stopLive } from "./live";
import { overviewPage } from "./pages/overview";
import { jobsPage } from "./pages/jobs";
import { jobPage } from "./pages/job";
import { submitPage } from "./pages/submit";
import { servicesPage } from "./pages/services";
import { reportsPage } from "./pages/reports";

export interface PageContext {
  session: Session;
  root: HTMLElement;
  /** Called when the page is left: stop timers and live listeners. */
  cleanup: (fn: () => void) => void;
  live: typeof onLive;
}

const app = document.getElementById("app")!;
let session: Session | null = null;
let cleanups: (() => void)[] = [];

const NAV: [string, string][] = [
  ["#/overview", "Overview"],
  ["#/jobs", "Jobs"],
  ["#/submit", "Submit"],
  ["#/services", "Services"],
  ["#/reports", "Reports"],
];

function loginPage(message = ""): void {
  stopLive();
  clear(app);
  const error = h("p", { class: "error", role: "alert", id: "login-error" }, message);
  const input = h("input", { id: "token", name: "token", type: "password", autocomplete: "current-password", required: true, "aria-describedby": "login-error" });
  const form = h(
    "form",
    { class: "login", "aria-labelledby": "login-title" },
    h("h1", { id: "login-title" }, "lowtide"),
    h("p", {}, "Log in with your API token (", h("code", {}, "lowtide token create NAME"), ")."),
    h("label", { for: "token" }, "API token"),
    input,
    h("button", { type: "submit" }, "Log in"),
    error,
  );
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    error.textContent = "";
    try {
      session = await postJson<Session>("/v1/session", { token: input.value });
      setCsrf(session.csrf_token);
      if (!location.hash || location.hash === "#/login") location.hash = "#/overview";
      else void route();
    } catch (err) {
      error.textContent = err instanceof ApiFailure ? err.message : String(err);
    }
  });
  app.appendChild(h("main", { id: "main" }, form));
  input.focus();
}

async function logout(): Promise<void> {
  try {
    await call("DELETE", "/v1/session");
  } finally {
    session = null;
    setCsrf("");
    location.hash = "#/login";
    loginPage("Logged out.");
  }
}

function shell(current: string): HTMLElement {
  const s = session!;
  const liveEl = h("span", { class: "live off", role: "status", "aria-live": "polite" }, "○ connecting");
  const nav = h(
    "nav",
    { "aria-label": "Main" },
    h("ul", {}, NAV.map(([href, label]) => h("li", {}, h("a", { href, "aria-current": current === href ? "page" : null }, label)))),
  );
  const who = h(
    "div",
    { class: "who" },
    liveEl,
    h("span", {}, `${s.name} (${s.role}${s.teams.length ? ", " + s.teams.join(", ") : ""})`),
    s.auth_enabled ? h("button", { type: "button", class: "link", onclick: () => void logout() }, "Log out") : null,
  );
  const header = h("header", { class: "top" }, h("a", { class: "brand", href: "#/overview" }, "lowtide"), nav, who);
  const main = h("main", { id: "main", tabindex: "-1" });
  clear(app);
  app.append(header, main);
  startLive(liveEl);
  return main;
}

async function route(): Promise<void> {
  for (const fn of cleanups) fn();
  cleanups = [];
  if (!session) {
    try {
      session = await get<Session>("/v1/session");
      setCsrf(session.csrf_token);
    } catch {
      loginPage();
      return;
    }
  }
  const hash = location.hash || "#/overview";
  if (hash === "#/login") {
    location.hash = "#/overview";
    return;
  }
  const parts = hash.slice(2).split("/").map(decodeURIComponent);
  const base = `#/${parts[0]}`;
  const root = shell(parts[0] === "job" ? "#/jobs" : base);
  const ctx: PageContext = { session: session!, root, cleanup: (fn) => cleanups.push(fn), live: onLive };
  const title = (t: string) => (document.title = `${t} · lowtide`);
  try {
    switch (parts[0]) {
      case "overview": title("Overview"); await overviewPage(ctx); break;
      case "jobs": title("Jobs"); await jobsPage(ctx); break;
      case "job": title(`Job ${parts[1]}`); await jobPage(ctx, parts[1] ?? ""); break;
      case "submit": title("Submit"); await submitPage(ctx); break;
      case "services": title("Services"); await servicesPage(ctx); break;
      case "reports": title("Reports"); await reportsPage(ctx); break;
      default: root.appendChild(h("p", {}, "No such page. "), ); root.appendChild(h("a", { href: "#/overview" }, "Go to the overview"));
    }
  } catch (err) {
    root.appendChild(h("p", { class: "error", role: "alert" }, err instanceof ApiFailure ? `${err.status}: ${err.message}` : String(err)));
  }
  const heading = root.querySelector("h1");
  if (heading) {
    heading.setAttribute("tabindex", "-1");
    heading.focus({ preventScroll: true });
  }
}

setLoggedOutHandler(() => {
  session = null;
  loginPage("Your session has ended; log in again.");
});
window.addEventListener("hashchange", () => void route());
void route();
