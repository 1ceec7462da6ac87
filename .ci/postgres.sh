#!/usr/bin/env bash
# Start a throwaway PostgreSQL for the store's tests (Debian's package; CI runs as root) and print its URL.
# Idempotent: installs the package if missing, starts the cluster if down, creates the role and database once.
# Only the URL goes to stdout, since the caller captures it: everything the tools print goes to stderr,
# and so does the server's inherited stdout (a daemon holding the caller's pipe would block it forever).
set -euo pipefail
{
  if ! command -v pg_lsclusters >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
  fi
  read -r ver name _ < <(pg_lsclusters --no-header | head -n1) || true
  if [ -z "${ver:-}" ]; then
    ver=$(ls /usr/lib/postgresql | sort -n | tail -n1); name=main
    pg_createcluster "$ver" "$name" >/dev/null
  fi
  pg_ctlcluster "$ver" "$name" status >/dev/null 2>&1 || pg_ctlcluster "$ver" "$name" start
  port=$(pg_lsclusters --no-header | awk -v v="$ver" -v n="$name" '$1==v && $2==n {print $3}')
  pg_isready -q -h 127.0.0.1 -p "$port" -t 30
  psql_pg() { su postgres -c "psql -p $port -tAq -c \"$1\""; }
  [ "$(psql_pg "SELECT 1 FROM pg_roles WHERE rolname='dit_serve'")" = "1" ] || \
    psql_pg "CREATE ROLE dit_serve LOGIN PASSWORD 'dit_serve'"
  [ "$(psql_pg "SELECT 1 FROM pg_database WHERE datname='dit_serve_test'")" = "1" ] || \
    psql_pg "CREATE DATABASE dit_serve_test OWNER dit_serve"
} >&2
echo "postgresql://dit_serve:dit_serve@127.0.0.1:$port/dit_serve_test"
