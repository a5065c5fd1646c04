// The dashboard talks only to lowtide's own API (same origin), with the session cookie and,
// on unsafe methods, the session's CSRF token (src/lowtide/api/session.py).
export interface ErrorItem { loc: string; msg: string }
export class ApiFailure extends Error {
  constructor(public status: number, public error: string, message: string, public errors: ErrorItem[]) {
    super(message);
  }
}

export interface Session { name: string; role: string; teams: string[]; csrf_token: string; expires_at: number | null; auth_enabled: boolean }

let csrf = "";
let onLoggedOut: () => void = () => {};

export function setCsrf(token: string): void { csrf = token; }
export function setLoggedOutHandler(fn: () => void): void { onLoggedOut = fn; }

export async function call<T>(method: string, path: string, body?: { text: string; type: string }): Promise<T> {
  const headers: Record<string, string> = { Accept: "application/json" };
  if (method !== "GET" && csrf) headers["X-CSRF-Token"] = csrf;
  if (body) headers["Content-Type"] = body.type;
  const res = await fetch(path, { method, headers, body: body?.text, credentials: "same-origin" });
  if (res.status === 204) return undefined as T;
  const ctype = res.headers.get("content-type") ?? "";
  const data: unknown = ctype.includes("json") ? await res.json() : await res.text();
  if (!res.ok) {
    const d = (typeof data === "object" && data !== null ? data : {}) as { error?: string; message?: string; errors?: ErrorItem[] };
    if (res.status === 401 && !path.startsWith("/v1/session")) onLoggedOut();
    throw new ApiFailure(res.status, d.error ?? "error", d.message ?? String(data), d.errors ?? []);
  }
  return data as T;
}

export const get = <T>(path: string): Promise<T> => call<T>("GET", path);
export const postJson = <T>(path: string, value: unknown): Promise<T> =>
  call<T>("POST", path, { text: JSON.stringify(value), type: "application/json" });
export const postYaml = <T>(path: string, text: string): Promise<T> => call<T>("POST", path, { text, type: "application/yaml" });

export async function logText(jobId: string, step: string, offset: number): Promise<string> {
  const res = await fetch(`/v1/jobs/${encodeURIComponent(jobId)}/steps/${encodeURIComponent(step)}/logs?offset=${offset}`, {
    credentials: "same-origin",
  });
  if (!res.ok) return "";
  return res.text();
}

// -- shapes (src/lowtide/api/schemas.py, services.py, reports.py, dashboard.py) --
export interface Job {
  id: string; name: string; team: string; owner: string; priority: number; state: string;
  submitted_at: number; started_at: number | null; finished_at: number | null; template: string | null;
  rerun_of: string | null; message: string; steps: Record<string, number>;
}
export interface Step {
  name: string; state: string; gpus: number; depends: string[]; reason: string; retries_used: number;
  max_retries: number; preemptions: number; last_checkpoint: string | null; last_checkpoint_at: number | null;
  command: string[];
}
export interface Attempt {
  id: number; step: string; number: number; state: string; node: string; gpus: number[]; started_at: number;
  ended_at: number | null; exit_code: number | null; signal: number | null; notice_at: number | null;
  stop_reason: string | null; message: string; record: Record<string, unknown>; lost_gpu_seconds: number | null; preempted: boolean;
}
export interface Checkpoint { attempt_id: number; step: string; label: string; progress: string | null; source: string; reported_at: number }
export interface JobEvent { at: number; step: string | null; attempt_id: number | null; kind: string; message: string }
export interface JobDetail {
  job: Job; spec: Record<string, unknown>; source_text: string; steps: Step[]; attempts: Attempt[];
  checkpoints: Checkpoint[]; events: JobEvent[];
}
export interface Gpu { index: number; holder: string; job_id: string | null; step: string | null; attempt_id: number | null; team: string | null; since: number }
export interface Pool { nodes: { name: string; gpus: Gpu[]; free: number }[]; total: number; free: number }
export interface Replica { id: string; slot: number; state: string; node: string | null; gpus: number[]; since: number; failures: number; message: string }
export interface Signals { replica: string; running: number | null; waiting: number | null; kv_usage: number | null; generation_tokens_per_s: number | null; stale: boolean }
export interface Service {
  name: string; model: string; gpus_per_replica: number; min_replicas: number; max_replicas: number; park: string;
  desired: number | null; needed: number | null; target: number; reason: string; guard: string | null; blocked: string;
  alert: string; signals: Signals[]; replicas: Replica[]; per_signal: Record<string, number | null>;
  load_history: LoadSample[];
}
export interface LoadSample { at: number; running: number; waiting: number; desired: number | null }
export interface Lending { mode: string; lendable_gpus: number; inference_claim_gpus: number; reserve_gpus: number; lending_open: boolean; return_by: number | null; fail_safe: string | null; reasons: string[] }
export interface Services { services: Service[]; lending: Lending | null }
export interface Reclaim { id: number; service: string | null; replica_id: string | null; reason: string; gpus: number; victims: number[]; state: string; detected_at: number; decided_at: number; notice_at: number | null; freed_at: number | null; healthy_at: number | null; total_s: number | null }
export interface Timeline { start: number; end: number; capacity: number; buckets: { start: number; end: number; serving: number; research: number; idle: number; parked: number; lent_idle: number; free: number }[] }
export interface SimulationRun { policy: string; figures: Record<string, number | null>; currency: string | null }
export interface SimulationReport { name: string; file: string; modified_at: number; runs: SimulationRun[]; error: string | null }
export interface Template { name: string; params: Record<string, unknown>; starter: string }
export interface MonthlyRow {
  key: string; team: string | null; jobs_run: number; previous_jobs_run: number; research_gpu_hours: number;
  previous_research_gpu_hours: number; change_gpu_hours: number; change_pct: number | null; equivalent_gpus: number;
  savings: number; preemptions: number; lost_gpu_hours: number;
}
export interface Monthly {
  month: string; previous_month: string; timezone: string; complete: boolean; currency: string; price_per_gpu_hour: number;
  capacity_gpu_hours: number; lent_gpu_hours: number; lent_gpus: number; total: MonthlyRow; teams: MonthlyRow[];
}
