#!/usr/bin/env bash
# The article's experiment on a real tiny LLM: llama-server (4 slots) with SmolLM2-135M on the CPU,
# alone and behind Sluice with each queue policy (cap, fifo, deadline, codel), under a steady
# overload and a spike. Same clients as bench/article.sh: open loop, Poisson arrivals, give up after
# 15 s; 10 % of them retry once after a refusal's Retry-After. About 30 minutes; needs
# `sluice engine build` first.
#
#   bench/llm.sh            # tables on stdout, files in .bench-out/llm
#
# llama-server does not count tokens spent on abandoned requests, so wasted work is measured from
# the client side with --stream (tokens streamed to clients that then gave up).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-.bench-out/llm}
POLICIES=${POLICIES:-direct,cap,fifo,deadline,codel}
mkdir -p "$OUT" docs/img
sluice() { "$PY" -m sluice.cli "$@"; }
port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

ENGINE_PORT=$(port)
ENGINE=http://127.0.0.1:$ENGINE_PORT
# Started directly (not through the shell function) so that $! is the process the trap must stop.
"$PY" -m sluice.cli engine start --slots 4 --port "$ENGINE_PORT" > "$OUT/engine.log" 2>&1 &
ENGINE_PID=$!
trap 'kill $ENGINE_PID 2>/dev/null || true; wait 2>/dev/null || true' EXIT
for _ in $(seq 100); do curl -sf "$ENGINE/health" >/dev/null && break; sleep 0.2; done

run() { sluice bench --out "$OUT" --no-progress --max-tokens 64 --stream "$@"; }
# Capacity: the engine saturated, clients that never give up.
run --target "$ENGINE" --mode direct --rate 6 --duration 30 --client-timeout 0 --label capacity
CAP=$("$PY" -c 'import json,sys; print(round(json.load(open(sys.argv[1]))["summary"]["goodput_steady_rps"], 2))' \
  "$OUT/capacity.json")
echo "measured capacity: $CAP req/s"
rate() { "$PY" -c "print(round($1 * $CAP, 2))"; }

# Each policy in turn on the same arrivals: the engine alone (direct), then a fresh gateway with
# --max-concurrency 4 and that --queue-policy in front of the same engine.
policies() {
  run --target "$ENGINE" --spawn-sluice --slots 4 --policies "$POLICIES" --capacity "$CAP" \
    --users 50 --retriers 0.1 "$@"
}
STEADY=(--rate "$(rate 1.8)" --duration 60)  # 1.8x, the article's overload
SPIKE=(--profile spike --rate "$(rate 0.5)" --peak "$(rate 5)" --spike-at 20 --spike-for 10 --duration 60)
policies "${STEADY[@]}" --label llm-steady
policies "${SPIKE[@]}" --label llm-spike
# codel as `sluice serve` runs it in front of the local engine it starts itself (burst_rise 1.0),
# then every run of a load in one table and one plot.
POLICIES=codel policies "${STEADY[@]}" --sluice-args=--queue-burst-rise=1 --label llm-rise1-steady
POLICIES=codel policies "${SPIKE[@]}" --sluice-args=--queue-burst-rise=1 --label llm-rise1-spike
for shape in steady spike; do
  runs=()
  for p in ${POLICIES//,/ }; do runs+=("$OUT/llm-$shape-$p.json"); done
  sluice bench compare "${runs[@]}" "$OUT/llm-rise1-$shape-codel.json" --name "llm-$shape"
  cp "$OUT/llm-$shape.png" "docs/img/llm-$shape.png"
done
