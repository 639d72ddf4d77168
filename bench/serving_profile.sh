#!/usr/bin/env bash
# Where the serving path spends its CPU: runs bench/serving.py and, once the load is steady, samples each Ray Serve
# and engine process with py-spy (flame-graph text, one file per process) and a `top` snapshot, into $OUT (or /tmp).
#   bench/serving_profile.sh [seconds to wait before sampling] -- <bench/serving.py arguments>
set -euo pipefail
export PATH=$PATH:/tmp/raysite/bin
out=${OUT:-/tmp}/profile
mkdir -p "$out"
wait_s=${1:-60}; shift; [ "${1:-}" = "--" ] && shift
python3 bench/serving.py --out "$out" "$@" > "$out/bench.log" 2>&1 &
bench=$!
sleep "$wait_s"
top -b -n 1 -c -w 200 | head -30 > "$out/top.txt"
for pattern in VattnIngress VattnEngine ProxyActor SchedulerActor WorkerActor; do
  pid=$(pgrep -f "$pattern" | head -1) || continue
  py-spy record -d 10 -r 100 -p "$pid" -f raw -o "$out/$pattern.txt" --nonblocking > /dev/null 2>&1 &
done
wait "$bench"
tail -8 "$out/bench.log"
cat "$out/top.txt"
