// Live updates: one EventSource on /v1/events/stream (src/lowtide/api/dashboard.py); pages
// subscribe and re-read what changed. The browser reconnects by itself.
type Listener = (kind: string, data: { changed?: string[] }) => void;

const listeners = new Set<Listener>();
let source: EventSource | null = null;
let statusEl: HTMLElement | null = null;

function setStatus(text: string, ok: boolean): void {
  if (!statusEl) return;
  statusEl.textContent = text;
  statusEl.className = ok ? "live ok" : "live off";
}

export function startLive(el: HTMLElement): void {
  statusEl = el;
  if (source) {
    if (source.readyState === EventSource.OPEN) setStatus("● live", true);
    return;
  }
  source = new EventSource("/v1/events/stream", { withCredentials: true });
  source.onopen = () => setStatus("● live", true);
  source.onerror = () => setStatus("○ reconnecting", false);
  for (const kind of ["jobs", "pool"]) {
    source.addEventListener(kind, (e) => {
      const data = JSON.parse((e as MessageEvent<string>).data) as { changed?: string[] };
      for (const l of listeners) l(kind, data);
    });
  }
}

export function stopLive(): void {
  source?.close();
  source = null;
}

export function onLive(fn: Listener): () => void {
  listeners.add(fn);
  return () => listeners.delete(fn);
}
