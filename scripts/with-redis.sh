#!/usr/bin/env bash
# Runs a command with REDIS_URL set: the caller's own, or else a throwaway redis-server
# started here on a free loopback port in a temp dir and stopped when the command ends.
# It never touches a Redis it did not start.
set -euo pipefail

if [[ -n "${REDIS_URL:-}" ]]; then
    exec "$@"
fi

dir="$(mktemp -d)"
pid=""
cleanup() {
    [[ -n "$pid" ]] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null
    rm -rf "$dir"
}
trap cleanup EXIT

for _ in $(seq 1 50); do
    port=$((20000 + RANDOM % 40000))
    redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no \
        --dir "$dir" --logfile "$dir/redis.log" &
    pid=$!
    for _ in $(seq 1 100); do
        # Only our own server counts: another Redis may already listen on that port.
        if redis-cli -p "$port" info server 2>/dev/null | grep -q "^process_id:$pid"$'\r'; then
            export REDIS_URL="redis://127.0.0.1:$port"
            echo "throwaway redis-server on $REDIS_URL" >&2
            "$@"
            exit $?
        fi
        kill -0 "$pid" 2>/dev/null || break # port taken: it exited; try another
        sleep 0.05
    done
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    pid=""
done
echo "could not start redis-server" >&2
exit 1
