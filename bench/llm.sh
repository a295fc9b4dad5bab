#!/usr/bin/env bash
# The article's experiment on a real tiny LLM: llama-server (4 slots) with SmolLM2-135M on the CPU,
# alone and behind Sluice, under a steady overload. Same clients as bench/article.sh: open loop,
# Poisson arrivals, give up after 15 s. About 4 minutes; needs `sluice engine build` first.
#
#   bench/llm.sh            # tables on stdout, files in .bench-out/llm
#
# llama-server does not count tokens spent on abandoned requests, so wasted work is measured from
# the client side with --stream (tokens streamed to clients that then gave up).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-.bench-out/llm}
mkdir -p "$OUT" docs/img
sluice() { "$PY" -m sluice.cli "$@"; }
port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

ENGINE_PORT=$(port); GATEWAY_PORT=$(port)
ENGINE=http://127.0.0.1:$ENGINE_PORT; GATEWAY=http://127.0.0.1:$GATEWAY_PORT
# Started directly (not through the shell function) so that $! is the process the trap must stop.
"$PY" -m sluice.cli engine start --slots 4 --port "$ENGINE_PORT" > "$OUT/engine.log" 2>&1 &
ENGINE_PID=$!
trap 'kill $ENGINE_PID ${GATEWAY_PID:-} 2>/dev/null || true; wait 2>/dev/null || true' EXIT
for _ in $(seq 100); do curl -sf "$ENGINE/health" >/dev/null && break; sleep 0.2; done
"$PY" -m sluice.cli serve --backend "$ENGINE" --max-concurrency 4 --port "$GATEWAY_PORT" \
  --log-level warning > "$OUT/sluice.log" 2>&1 &
GATEWAY_PID=$!
for _ in $(seq 100); do curl -sf "$GATEWAY/readyz" >/dev/null && break; sleep 0.2; done

run() { sluice bench --out "$OUT" --no-progress --max-tokens 64 --stream "$@"; }
# Capacity: the engine saturated, clients that never give up.
run --target "$ENGINE" --mode direct --rate 6 --duration 30 --client-timeout 0 --label capacity
CAP=$("$PY" -c 'import json,sys; print(round(json.load(open(sys.argv[1]))["summary"]["goodput_steady_rps"], 2))' \
  "$OUT/capacity.json")
echo "measured capacity: $CAP req/s"
RATE=$("$PY" -c "print(round(1.8 * $CAP, 1))")  # 1.8x, the article's overload
run --target "$ENGINE" --mode direct --rate "$RATE" --duration 60 --capacity "$CAP" --label direct-steady
run --target "$GATEWAY" --mode sync --rate "$RATE" --duration 60 --capacity "$CAP" --users 50 --label sluice-steady
sluice bench compare "$OUT/direct-steady.json" "$OUT/sluice-steady.json" --name llm-steady --out "$OUT"
cp "$OUT/llm-steady.png" docs/img/llm-steady.png
