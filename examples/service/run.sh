#!/usr/bin/env bash
# The service walk-through of docs/service.md, end to end, in one script.
#
#   bash examples/service/run.sh [WORKDIR]      # default: a new temporary folder
#
# It loads the probe, starts examples/service/server.py, wakes the probe with exec_range "none",
# selects op 2 (the first decoder layer), sends one chat request, waits for the dump to be on
# disk, stops the service and unloads the probe. Needs atb-probe, fastapi, uvicorn and curl.
# PORT (default 1025) picks the service's port.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WORK="${1:-$(mktemp -d)}"
mkdir -p "$WORK"
WORK="$(cd "$WORK" && pwd)"
PORT="${PORT:-1025}"
URL="http://127.0.0.1:$PORT"
cd "$WORK"
rm -f config.json

say() { printf '\n== %s\n' "$*"; }
wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...: poll until COMMAND succeeds
    local limit=$1 what=$2 i
    shift 2
    for ((i = 0; i < limit * 10; i++)); do
        "$@" >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    echo "gave up waiting for $what" >&2
    return 1
}
write_config() {  # write_config EXEC_RANGE IDS
    cat > config.json <<EOF
{
    "task": "tensor",
    "dump_enable": true,
    "exec_range": "$1",
    "ids": "$2",
    "op_name": "",
    "save_child": false,
    "device": "",
    "filter_level": 1
}
EOF
}
chat() {
    curl -sS -H "Content-Type: application/json" -X POST -d '{"model": "tiny-llama",
        "messages": [{"role": "system", "content": {"type": "text",
                      "text": "You are a helpful assistant"}}], "max_tokens": 3}' \
        "$URL/v1/chat/completions"
    echo
}

say "1. where the load scripts are"
ATB_HOME="$(atb-probe where)"
echo "$ATB_HOME"

say "2. load the probe into this shell (config.json does not exist yet)"
source "$ATB_HOME/load_atb_probe.sh" --output="$WORK" --config="$WORK/config.json"

say "3. start the service"
python "$HERE/server.py" --port "$PORT" &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true' EXIT
wait_for 120 "the service" curl -sf "$URL/health"
chat

say "4. wake the probe: dump_enable true, exec_range \"none\""
write_config none ""
wait_for 5 "the wake-up" test -d atb_dump_data/data
echo "atb_dump_data/data exists: the probe is awake"

say "5. select op 2 in every round, wait until it is in effect, send one request"
write_config all 2
wait_for 5 "the new config" grep -q '"ids": "2"' "atb_dump_data/status/0_$SERVER.json"
chat
atb-probe status --wait 60 "$WORK"
ls "atb_dump_data/data/0_$SERVER"

say "6. stop the service, unload the probe"
kill -INT "$SERVER"
wait "$SERVER" || true
trap - EXIT
source "$ATB_HOME/unload_atb_probe.sh"
atb-probe status "$WORK"
echo "the dump is in $WORK/atb_dump_data"
