#!/usr/bin/env bash
# The lowtide demo: an embedded control plane on declared GPUs (no GPU needed), a real 3-step
# job (prep -> train -> eval) and a templated job, then the pool, the job record and metrics.
# Leaves nothing running. State goes to .lowtide-demo/ (fresh each run).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"

DEMO_DIR="$PWD/.lowtide-demo"
rm -rf "$DEMO_DIR"
mkdir -p "$DEMO_DIR"
PORT=$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')

export LOWTIDE_CONFIG="$PWD/examples/lowtide.yaml"
export LOWTIDE_STATE_DIR="$DEMO_DIR/state"
export LOWTIDE_API__PORT="$PORT"
export LOWTIDE_TICK_SECONDS=0.5

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

say "lowtide up (declared GPUs: 2 nodes x 4), API on port $PORT"
lowtide up >"$DEMO_DIR/server.log" 2>&1 &
SERVER=$!
cleanup() { kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; }
trap cleanup EXIT
for _ in $(seq 1 100); do
  curl -fsS "http://127.0.0.1:$PORT/healthz" >/dev/null 2>&1 && break
  kill -0 "$SERVER" 2>/dev/null || { cat "$DEMO_DIR/server.log"; exit 1; }
  sleep 0.2
done
curl -fsS "http://127.0.0.1:$PORT/healthz"; echo

say "lowtide validate: a good spec, then a broken one (exit 2, located errors)"
lowtide validate examples/jobs/sft-dag.yaml
printf 'name: broken\nsteps:\n  - name: train\n    command: [python, t.py]\n    depends: [prepp]\n    gpus: 64\n' >"$DEMO_DIR/broken.yaml"
set +e; lowtide validate "$DEMO_DIR/broken.yaml"; code=$?; set -e
echo "(exit code $code)"; [ "$code" -eq 2 ]

say "lowtide submit examples/jobs/sft-dag.yaml --wait"
lowtide submit examples/jobs/sft-dag.yaml -p steps=200 --wait
JOB=$(lowtide jobs --json | python -c 'import json,sys; print(json.load(sys.stdin)["jobs"][0]["id"])')

say "lowtide show $JOB"
lowtide show "$JOB"

say "lowtide logs $JOB train"
lowtide logs "$JOB" train

say "a job from a template: lowtide submit examples/jobs/sft-from-template.yaml -p lr=0.1 --wait"
lowtide submit examples/jobs/sft-from-template.yaml -p lr=0.1 -p steps=100 --wait

say "lowtide pool"
lowtide pool

say "lowtide jobs"
lowtide jobs

say "metrics (Prometheus text)"
curl -fsS "http://127.0.0.1:$PORT/metrics" | grep -E '^lowtide_(jobs|gpus|queue)' || true

say "done: the API docs are at http://127.0.0.1:$PORT/docs while lowtide runs (run 'lowtide up -c examples/lowtide.yaml')"
