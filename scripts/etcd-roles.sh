#!/usr/bin/env bash
# Creates toolgate's least-privilege etcd users and roles, then turns etcd authentication on.
#
#   scripts/etcd-roles.sh PASSWORD_DIR SERVICE...
#
# etcdctl reaches etcd through its usual variables (ETCDCTL_ENDPOINTS, ETCDCTL_CACERT,
# ETCDCTL_CERT, ETCDCTL_KEY); ETCDCTL_USER=root:<password> once auth is on. PASSWORD_DIR holds
# one file per user, named after it: root, toolgate-xds, registrar-<service>. Safe to run again
# (existing users and roles are kept, permissions granted again).
#
# The layout:
#   root                 etcd's own administrator (needed to turn auth on).
#   toolgate-xds         reads everything under /mcp/; writes only /mcp/breakers/ (fleet
#                        breaker openings), /mcp/service-ages/ (each service's age for naming)
#                        and, for the admin API, /mcp/overrides/ and /mcp/policies/,
#                        /mcp/virtual/ and /mcp/auth/. It cannot write a registration.
#   registrar-<service>  reads and writes only /mcp/services/<service>/: a registrar of one
#                        service cannot register, or remove, an instance of another.
set -euo pipefail

if [ $# -lt 2 ]; then
  echo "usage: $0 PASSWORD_DIR SERVICE..." >&2
  exit 2
fi
dir=$1; shift
ETCDCTL=${ETCDCTL:-etcdctl}
PREFIX=${TOOLGATE_PREFIX:-/mcp/}

password() {
  local f="$dir/$1"
  [ -s "$f" ] || { echo "$0: no password file $f" >&2; exit 2; }
  head -n1 "$f"
}

user() { # name
  if ! "$ETCDCTL" user get "$1" >/dev/null 2>&1; then
    password "$1" | "$ETCDCTL" user add "$1" --interactive=false >/dev/null
  fi
}

role() { # name
  "$ETCDCTL" role get "$1" >/dev/null 2>&1 || "$ETCDCTL" role add "$1" >/dev/null
}

grant() { # role read|readwrite prefix
  "$ETCDCTL" role grant-permission "$1" "$2" "$3" --prefix=true >/dev/null
}

user root
"$ETCDCTL" user grant-role root root >/dev/null 2>&1 || true

role toolgate-xds
grant toolgate-xds read "$PREFIX"
grant toolgate-xds readwrite "${PREFIX}breakers/"
grant toolgate-xds readwrite "${PREFIX}service-ages/"
grant toolgate-xds readwrite "${PREFIX}overrides/"
grant toolgate-xds readwrite "${PREFIX}policies/"
grant toolgate-xds readwrite "${PREFIX}virtual/"
grant toolgate-xds readwrite "${PREFIX}auth/"
# Each toolgate-xds registers its admin listener here, under a lease, for the fleet to find.
grant toolgate-xds readwrite "${PREFIX}xds/"
user toolgate-xds
"$ETCDCTL" user grant-role toolgate-xds toolgate-xds >/dev/null

for svc in "$@"; do
  case $svc in
    *[!A-Za-z0-9_.-]*|'') echo "$0: invalid service name '$svc'" >&2; exit 2 ;;
  esac
  role "registrar-$svc"
  grant "registrar-$svc" readwrite "${PREFIX}services/$svc/"
  user "registrar-$svc"
  "$ETCDCTL" user grant-role "registrar-$svc" "registrar-$svc" >/dev/null
done

"$ETCDCTL" auth enable >/dev/null 2>&1 || true
echo "etcd-roles: users root, toolgate-xds, ${*/#/registrar-}; authentication on"
