# Sourced by the client test scripts (tests/python/run.sh, tests/lmeval/run.sh):
#   serve_on_free_port BIN PYTHON [handoff serve flags...]
# starts `handoff serve` on a free loopback port ($HANDOFF_TEST_PORT if
# set), waits until /health answers, and sets URL. The server is stopped
# when the script exits, after running $ON_EXIT if the caller set it.
serve_on_free_port() {
    local bin="$1" py="$2"
    shift 2
    local port
    port="${HANDOFF_TEST_PORT:-$("$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}"
    URL="http://127.0.0.1:$port"
    "$bin" serve --port "$port" "$@" &
    SERVE_PID=$!
    trap 'kill "$SERVE_PID" 2>/dev/null || true; wait "$SERVE_PID" 2>/dev/null || true; eval "${ON_EXIT:-}"' EXIT
    for _ in $(seq 1 600); do
        if "$py" -c "import urllib.request; urllib.request.urlopen('$URL/health', timeout=1)" 2>/dev/null; then
            return 0
        fi
        kill -0 "$SERVE_PID" 2>/dev/null || { echo "handoff serve exited before becoming healthy" >&2; exit 1; }
        sleep 0.5
    done
    echo "handoff serve did not become healthy within 300 s" >&2
    exit 1
}
