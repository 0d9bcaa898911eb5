#!/usr/bin/env bash
# make demo: etcd, toolgate-xds, Envoy and three sample MCP services (two instances each, each
# under toolgate-register, which restarts a crashed server), all on 127.0.0.1. Ctrl-C stops
# everything.
set -euo pipefail
cd "$(dirname "$0")/.."

# Absolute, so the commands the banner prints work from any directory.
BIN=$PWD/target/release
TOOLS=.venv/toolgate-bin
RUN=.toolgate/demo
ETCD_PORT=${ETCD_PORT:-23790}
XDS_PORT=${XDS_PORT:-18000}
ADMIN_PORT=${ADMIN_PORT:-19000}
GATEWAY_PORT=${GATEWAY_PORT:-10000}
ENVOY_ADMIN_PORT=${ENVOY_ADMIN_PORT:-9901}
ETCD="http://127.0.0.1:$ETCD_PORT"

rm -rf "$RUN" && mkdir -p "$RUN/logs"
pids=()
start() { # name, command...: runs in its own process group, output to logs/<name>.log
  local name=$1; shift
  setsid "$@" >"$RUN/logs/$name.log" 2>&1 &
  pids+=($!)
}
stop_all() {
  trap - INT TERM EXIT
  echo
  echo "demo: stopping (registrars revoke their leases first)"
  # Registrars and servers first, so instances leave the registry cleanly; etcd last.
  for ((i=${#pids[@]}-1; i>=0; i--)); do kill -TERM -- "-${pids[$i]}" 2>/dev/null || true; done
  for _ in $(seq 50); do
    alive=0; for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break; sleep 0.1
  done
  for p in "${pids[@]}"; do kill -KILL -- "-$p" 2>/dev/null || true; done
  echo "demo: stopped; logs are in $RUN/logs"
}
trap stop_all INT TERM EXIT

wait_http() { # url, what
  for _ in $(seq 200); do curl -fsS -o /dev/null "$1" 2>/dev/null && return 0; sleep 0.05; done
  echo "demo: $2 did not come up; see $RUN/logs" >&2; exit 1
}

start etcd "$TOOLS/etcd" --name demo --data-dir "$RUN/etcd.data" \
  --listen-client-urls "$ETCD" --advertise-client-urls "$ETCD" \
  --listen-peer-urls "http://127.0.0.1:$((ETCD_PORT+1))" --initial-advertise-peer-urls "http://127.0.0.1:$((ETCD_PORT+1))" \
  --initial-cluster "demo=http://127.0.0.1:$((ETCD_PORT+1))" --listen-metrics-urls ""
wait_http "$ETCD/health" etcd

# The admin token guards overrides and policies; a fresh one per demo, readable only by us.
TOKEN_FILE="$RUN/admin.token"
(umask 077; head -c 18 /dev/urandom | base64 | tr -d '/+=' >"$TOKEN_FILE")
start toolgate-xds "$BIN/toolgate-xds" serve --etcd "$ETCD" \
  --xds-listen "127.0.0.1:$XDS_PORT" --admin-listen "127.0.0.1:$ADMIN_PORT" --state-dir "$RUN/xds.state" \
  --admin-token-file "$TOKEN_FILE"
wait_http "http://127.0.0.1:$ADMIN_PORT/healthz" toolgate-xds

# --restart on-failure is the default: a crashed server is deregistered at once and started
# again. The 5 s delay (jittered down to 2.5 s) leaves the breaker exercise below the time to
# show the breaker opening before the servers are back.
port=9101
for svc in inventory finance code; do
  for n in 1 2; do
    start "$svc-$n" "$BIN/toolgate-register" --etcd "$ETCD" --service "$svc" \
      --endpoint "127.0.0.1:$port" --instance-id "$svc-$n" --restart-delay 5s \
      --tools "$(case $svc in inventory) echo query_inventory_db,query_cached_inventory;; finance) echo tax_calc;; code) echo ast_parse;; esac)" \
      -- "$BIN/toolgate-demo" --service "$svc" --listen "127.0.0.1:$port" --instance-id "$svc-$n"
    port=$((port+1))
  done
done

"$BIN/toolgate-xds" bootstrap --node-id demo-envoy --listen "127.0.0.1:$GATEWAY_PORT" \
  --xds "127.0.0.1:$XDS_PORT" --admin "127.0.0.1:$ENVOY_ADMIN_PORT" \
  --filter target/wasm32-wasip1/release/toolgate_filter.wasm >"$RUN/envoy.json"
start envoy "$TOOLS/envoy" -c "$RUN/envoy.json" --concurrency 2 --use-dynamic-base-id --log-level info
wait_http "http://127.0.0.1:$ENVOY_ADMIN_PORT/ready" envoy

for _ in $(seq 200); do
  n=$(curl -fsS "http://127.0.0.1:$ADMIN_PORT/v1/registry" 2>/dev/null | grep -o '"instance_id"' | wc -l || true)
  [ "${n:-0}" -ge 6 ] && break; sleep 0.1
done

cat <<EOT

toolgate demo is running (Ctrl-C stops it):
  MCP (one URL)  http://127.0.0.1:$GATEWAY_PORT/mcp   every tool of every service, for your agent
  per service    http://127.0.0.1:$GATEWAY_PORT/mcp/inventory
                 http://127.0.0.1:$GATEWAY_PORT/mcp/finance
                 http://127.0.0.1:$GATEWAY_PORT/mcp/code
  etcd           $ETCD
  console        http://127.0.0.1:$ADMIN_PORT/ui/   (admin token: $TOKEN_FILE)
  registry       http://127.0.0.1:$ADMIN_PORT/v1/registry
  metrics        http://127.0.0.1:$ADMIN_PORT/metrics
  envoy admin    http://127.0.0.1:$ENVOY_ADMIN_PORT/clusters
  logs           $RUN/logs/

Call a tool through the gateway (initialize, then tools/call):
  scripts/mcp-call.sh http://127.0.0.1:$GATEWAY_PORT/mcp finance__tax_calc '{"amount":100,"region":"de"}'

Put another MCP server behind the demo: run it under toolgate-register, which registers it in
etcd once it answers (its tools listed over MCP) and restarts it if it crashes. For example a
lab server, whose tools then appear on /mcp as lab__echo, lab__read_order, lab__write_order:
  $BIN/toolgate-register --etcd $ETCD --service lab --endpoint 127.0.0.1:9201 -- $BIN/toolgate-lab --listen 127.0.0.1:9201
Any MCP server that speaks Streamable HTTP joins the same way: its address after --endpoint,
its own command after --. A stdio server joins with --stdio (the registrar serves it over HTTP,
a process per MCP session), for example the reference memory server, as memory__*:
  $BIN/toolgate-register --etcd $ETCD --service memory --stdio -- $PWD/tests/node/node_modules/.bin/mcp-server-memory

See a breaker work: crash both finance servers (SIGKILL), then call tax_calc at once. The first
calls come back as tool results explaining the failure; after 10 the breaker opens and the
gateway answers at once, telling the model not to retry for a while. Meanwhile their
registrars restart the servers (2.5-5 s later) and register them again; once the breaker's
open time is over, calls reach them again:
  pkill -KILL -f '^$BIN/toolgate-demo --service finance'; for i in \$(seq 12); do scripts/mcp-call.sh http://127.0.0.1:$GATEWAY_PORT/mcp/finance tax_calc '{"amount":1,"region":"de"}'; done

The fleet as an operator sees it, and a tool cut by hand (everywhere, until lifted):
  $BIN/toolgate-xds status --admin http://127.0.0.1:$ADMIN_PORT
  curl -X PUT -H "Authorization: Bearer \$(cat $TOKEN_FILE)" http://127.0.0.1:$ADMIN_PORT/v1/overrides/code/ast_parse \\
       -d '{"mode":"force_open","reason":"parser upgrade in progress, use a text search instead"}'
  curl -X DELETE -H "Authorization: Bearer \$(cat $TOKEN_FILE)" http://127.0.0.1:$ADMIN_PORT/v1/overrides/code/ast_parse

EOT
while true; do sleep 1; done
