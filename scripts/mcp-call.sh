#!/usr/bin/env bash
# Calls one MCP tool over Streamable HTTP with curl: initialize, initialized, tools/call.
# usage: scripts/mcp-call.sh URL TOOL [ARGUMENTS_JSON]
# With TOKEN set, every request carries `Authorization: Bearer $TOKEN` (a gateway with auth on).
set -euo pipefail
url=${1:?usage: mcp-call.sh URL TOOL [ARGUMENTS_JSON]}
tool=${2:?usage: mcp-call.sh URL TOOL [ARGUMENTS_JSON]}
args=${3:-{\}}
hdrs=$(mktemp); trap 'rm -f "$hdrs"' EXIT
accept='Accept: application/json, text/event-stream'
auth=(); [ -n "${TOKEN:-}" ] && auth=(-H "Authorization: Bearer $TOKEN")
curl -sS -D "$hdrs" -o /dev/null -H "$accept" -H 'Content-Type: application/json' "${auth[@]}" "$url" \
  -d '{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"mcp-call.sh","version":"1"}}}'
session=$(grep -i '^mcp-session-id:' "$hdrs" | cut -d' ' -f2 | tr -d '\r' || true)
sh_hdr=(); [ -n "$session" ] && sh_hdr=(-H "Mcp-Session-Id: $session")
[ -n "${TOKEN:-}" ] && sh_hdr+=(-H "Authorization: Bearer $TOKEN")
curl -sS -o /dev/null -H "$accept" -H 'Content-Type: application/json' "${sh_hdr[@]}" "$url" \
  -d '{"jsonrpc":"2.0","method":"notifications/initialized"}'
curl -sS -H "$accept" -H 'Content-Type: application/json' -H 'MCP-Protocol-Version: 2025-06-18' "${sh_hdr[@]}" "$url" \
  -d "{\"jsonrpc\":\"2.0\",\"id\":2,\"method\":\"tools/call\",\"params\":{\"name\":\"$tool\",\"arguments\":$args}}"
echo
