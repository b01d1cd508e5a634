#!/usr/bin/env bash
# Instructions per lock cycle on both sides of the wire, counted by callgrind:
# the same figure on a loaded machine as on an idle one.
#
# For each kind of cycle of bench_redis (raw, fenced, rslock, with_lock), a
# private redis-server on a free loopback port runs under callgrind while
# `bench_redis --cycles N KIND` (itself under callgrind) runs N cycles
# against it, for two values of N; the difference of the totals over the
# difference of N is the cost of one cycle, without start-up and warm-up.
# One cycle at a time, on one connection: every command pays its own
# network reads and writes on the server, as in the P1 line.
#
#   cargo build --release -p lock-redis --example bench_redis
#   bash lock-redis/examples/server_instructions.sh [KIND ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
bench=target/release/examples/bench_redis
[ -x "$bench" ] || { echo "build it first: cargo build --release -p lock-redis --example bench_redis" >&2; exit 64; }
command -v valgrind >/dev/null || { echo "valgrind is needed" >&2; exit 69; }
kinds=("$@")
[ ${#kinds[@]} -gt 0 ] || kinds=(raw fenced rslock with_lock)
# shellcheck source=callgrind_server.sh
. lock-redis/examples/callgrind_server.sh
small=1000
large=3000


# Prints "<server instructions> <client instructions>" for n cycles of kind.
count() {
  local kind=$1 n=$2
  start_server "$work/server.$kind.$n"
  REDIS_URL="redis://127.0.0.1:$port" valgrind --tool=callgrind \
    --callgrind-out-file="$work/client.$kind.$n" "$bench" --cycles "$n" "$kind" 2>/dev/null
  stop_server
  echo "$(total "$work/server.$kind.$n") $(total "$work/client.$kind.$n")"
}

printf '%-10s %22s %22s\n' kind "server instr/cycle" "client instr/cycle"
for kind in "${kinds[@]}"; do
  read -r s1 c1 < <(count "$kind" "$small")
  read -r s2 c2 < <(count "$kind" "$large")
  printf '%-10s %22d %22d\n' "$kind" $(((s2 - s1) / (large - small))) $(((c2 - c1) / (large - small)))
done
