#!/usr/bin/env bash
# The article's experiment on the simulator, end to end: the engine's measured capacity, then the
# engine alone and Sluice in front of it, under a steady 10 req/s and under a 3 → 30 → 3 req/s
# spike. Every run starts its own simulator (and gateway) on free ports and stops it afterwards.
#
#   bench/article.sh            # about 10 minutes; tables on stdout, files in .bench-out/article
#
# Everything runs on this machine's cores, so run it on a quiet machine: the load average at the
# start and end of each run is recorded in its result (a busy CPU slows the simulated engine).
# The comparison plots are copied to docs/img/ for docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${OUT:-.bench-out/article}
mkdir -p "$OUT" docs/img

sluice() { "$PY" -m sluice.cli "$@"; }
run() { sluice bench --out "$OUT" --no-progress "$@"; }

# Capacity: the engine alone, saturated (8 req/s against ~5.5), clients that never give up. The
# measure is "goodput after the first answer": answers per second while the batch is full.
run --spawn-sim article --rate 8 --duration 40 --client-timeout 0 --label capacity
CAP=$("$PY" -c 'import json,sys; print(round(json.load(open(sys.argv[1]))["summary"]["goodput_steady_rps"], 2))' \
  "$OUT/capacity.json")
echo "measured capacity: $CAP req/s"

# Steady 10 req/s for 60 s (the defaults), clients give up at 15 s (the default). Sluice runs twice:
# as the article's clients reach it (anonymous, one caller), and as 50 users with a key each.
run --spawn-sim article --capacity "$CAP" --label direct-steady
run --spawn-sim article --spawn-sluice --capacity "$CAP" --label sluice-steady
run --spawn-sim article --spawn-sluice --capacity "$CAP" --users 50 --label sluice-50-users-steady

# Spike: 3 req/s, 30 req/s from 20 s to 30 s, 3 req/s until 60 s (--peak/--spike-at/--spike-for defaults).
run --spawn-sim article --capacity "$CAP" --profile spike --rate 3 --label direct-spike
run --spawn-sim article --spawn-sluice --capacity "$CAP" --profile spike --rate 3 --label sluice-spike
run --spawn-sim article --spawn-sluice --capacity "$CAP" --profile spike --rate 3 --users 50 \
  --label sluice-50-users-spike

for shape in steady spike; do
  sluice bench compare "$OUT/direct-$shape.json" "$OUT/sluice-$shape.json" "$OUT/sluice-50-users-$shape.json" \
    --name "$shape"
  cp "$OUT/$shape.png" "docs/img/article-$shape.png"
done
