#!/usr/bin/env bash
# `make demo-cli`: the CLI walk-through: an embedded control plane on declared GPUs (no GPU needed), a real 3-step
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
# As root, steps run isolated: one uid per job in the lowtide-step group (`make demo` creates the
# user), their artifacts outside the state dir, which steps cannot enter (docs/architecture.md §6.4).
if [ "$(id -u)" = 0 ] && id -u lowtide-step >/dev/null 2>&1; then
  if python - <<'PY'
import pathlib, sys
import lowtide
dirs = [pathlib.Path(sys.executable).resolve().parent, pathlib.Path(sys.prefix), pathlib.Path(lowtide.__file__).parent]
sys.exit(0 if all(p.stat().st_mode & 0o001 for d in dirs for p in [d, *d.parents]) else 1)
PY
  then
    export LOWTIDE_EXECUTOR__RUN_AS=lowtide-step
    export LOWTIDE_ARTIFACT_ROOT="$DEMO_DIR/artifacts"
  else
    echo "note: this Python lies where other users cannot reach it; steps run as root (not isolated)"
  fi
fi

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

say "part one done (the API docs are at /docs while lowtide runs)"

# ---------------------------------------------------------------------------------------------
# Part two: an inference service next to research. Emulated vLLM replicas behind lowtide's
# gateway; load makes inference take GPUs, a research job waits for lendable GPUs, and gets them
# when the load is gone and the extra replicas are put to sleep.
kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true
read -r API GW BASE <<<"$(python - <<'PY'
import socket
def free():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p
for base in range(23000, 60000, 101):
    try:
        socks = []
        for p in range(base, base + 3):
            s = socket.socket(); s.bind(("127.0.0.1", p)); socks.append(s)
        break
    except OSError:
        continue
    finally:
        for s in socks: s.close()
print(free(), free(), base)
PY
)"
python - "$DEMO_DIR/inference.yaml" "$API" "$GW" "$BASE" <<'PY'
import sys, yaml
out, api, gw, base = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cfg = yaml.safe_load(open("examples/lowtide-inference.yaml"))
cfg.update(state_dir=out.rsplit("/", 1)[0] + "/inference-state", templates_dir="../examples/templates",
           tick_seconds=0.5, api={"port": api})
svc = cfg["services"][0]
svc.update(base_port=base, gateway_port=gw)
svc["autoscale"].update(scale_up_window="5s", scale_down_stabilization="15s")
yaml.safe_dump(cfg, open(out, "w"))
PY
# Part two's trainers read another job's outputs (the prepared data): that needs one uid for all
# jobs, so it runs without executor.run_as (cross-job inputs are private under run_as).
unset LOWTIDE_STATE_DIR LOWTIDE_API__PORT LOWTIDE_TICK_SECONDS LOWTIDE_EXECUTOR__RUN_AS LOWTIDE_ARTIFACT_ROOT
export LOWTIDE_CONFIG="$DEMO_DIR/inference.yaml"

say "lowtide up with an inference service: 1..3 emulated vLLM replicas of 2 GPUs, gateway on :$GW"
lowtide up --stop-replicas-on-exit >"$DEMO_DIR/server-inference.log" 2>&1 &
SERVER=$!
for _ in $(seq 1 150); do
  lowtide services --json 2>/dev/null | python -c 'import json,sys; d=json.load(sys.stdin); sys.exit(0 if any(r["state"]=="SERVING" for r in d["services"][0]["replicas"]) else 1)' && break
  kill -0 "$SERVER" 2>/dev/null || { cat "$DEMO_DIR/server-inference.log"; exit 1; }
  sleep 0.2
done
lowtide services

say "research on the lent GPUs: two trainers of 2 GPUs (one checkpoints every 50 steps, one every 400)"
lowtide submit examples/jobs/sft-dag.yaml -p steps=20 --wait >/dev/null   # prepares a data set quickly
DATA=$(lowtide jobs --json | python -c 'import json,sys; print(json.load(sys.stdin)["jobs"][0]["id"])')
DATA_DIR=$(lowtide show "$DATA" --json | python -c 'import json,sys; print([s for s in json.load(sys.stdin)["steps"] if s["name"]=="prep"][0]["outputs"])')
for every in 50 400; do
  cat >"$DEMO_DIR/train-$every.yaml" <<YAML
name: train-every-$every
team: research
grace_seconds: 60
steps:
  - name: train
    command: [python, -m, lowtide.examples.train, --data, "$DATA_DIR", --out, "{{outputs}}",
              --steps, "1500", --step-seconds, "0.02", --checkpoint-every, "$every"]
    gpus: 2
    checkpoint: true
YAML
done
OFTEN=$(lowtide submit "$DEMO_DIR/train-50.yaml" --json | python -c 'import json,sys; print(json.load(sys.stdin)["id"])')
RARELY=$(lowtide submit "$DEMO_DIR/train-400.yaml" --json | python -c 'import json,sys; print(json.load(sys.stdin)["id"])')
sleep 5
lowtide pool

say "a load surge through the gateway: lowtide loadgen --trace synthetic:constant,rate=10 (20 s)"
lowtide loadgen --trace "synthetic:constant,rate=10" --target "http://127.0.0.1:$GW" --speedup 1 \
  --duration 20 --emulator-hints >"$DEMO_DIR/loadgen.txt" 2>&1 &
LOAD=$!
sleep 12
say "inference takes GPUs back: the trainer that loses the least work since its checkpoint gets notice"
lowtide reclaims
lowtide services
lowtide show "$OFTEN" | sed -n '1,14p'
wait "$LOAD" || true
say "the load replay's report (no request failed while replicas came and went)"
cat "$DEMO_DIR/loadgen.txt"

say "load gone: after the stabilisation window the extra replicas sleep and the trainer resumes from its checkpoint"
for _ in $(seq 1 360); do
  states=$(for j in "$OFTEN" "$RARELY"; do lowtide show "$j" --json | python -c 'import json,sys; print(json.load(sys.stdin)["job"]["state"])'; done | sort -u | tr '\n' ' ')
  [ "$states" = "SUCCEEDED " ] && break
  case "$states" in *FAILED*|*CANCELLED*) break ;; esac
  sleep 0.5
done
lowtide show "$OFTEN"
lowtide services
[ "$states" = "SUCCEEDED " ]

say "accounting on the ledger: lowtide report --since 1h --by job (GPU-hours, work lost to preemption)"
lowtide report --since 1h --by job

say "done. Both configurations are in examples/: lowtide.yaml and lowtide-inference.yaml"
