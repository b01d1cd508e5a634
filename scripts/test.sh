#!/usr/bin/env bash
# Every test of the workspace, as CI runs them: the README's second command.
#
# - Installs what is missing, as .ci/install-etcd does (with sudo when not
#   root): `protoc` and `libprotobuf-dev` (lock-etcd's build compiles
#   etcd's API), and etcd and etcdctl 3.4 for its tests, unpacked into
#   /opt/withlock-ci/etcd without starting a system etcd. They are put on
#   PATH for this run only.
# - Says so when no Redis or PostgreSQL answers on the default addresses
#   (REDIS_URL and DATABASE_URL override them; see CONTRIBUTING.md).
# - Runs `cargo test --workspace`, the fault checker one minute per backend
#   (CHAOS_SECONDS, default 60). Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."

etcd_bin="$(bash .ci/install-etcd)"
export PATH="$etcd_bin:$PATH"

if command -v redis-cli >/dev/null && ! redis-cli -u "${REDIS_URL:-redis://127.0.0.1:6379}" ping >/dev/null 2>&1; then
  echo "note: no Redis answers at ${REDIS_URL:-redis://127.0.0.1:6379}; the Redis tests start a redis-server of their own if one is installed" >&2
fi
if command -v pg_isready >/dev/null && ! pg_isready -d "${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test}" -q; then
  echo "error: no PostgreSQL answers at ${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/test} (set DATABASE_URL)" >&2
  exit 1
fi

export CHAOS_SECONDS="${CHAOS_SECONDS:-60}"
exec cargo test --workspace "$@"
