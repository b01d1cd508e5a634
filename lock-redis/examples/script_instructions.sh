#!/usr/bin/env bash
# Server instructions per lock cycle of the Redis scripts alone, counted by
# callgrind: no client of this crate, no network wait, the same figure on a
# loaded machine as on an idle one.
#
# A private redis-server on a free loopback port runs under callgrind while
# a small driver (python3, no modules) sends N cycles on distinct keys,
# pipelined 500 cycles per write, for N = 0 and N = 10,000; the difference
# of the totals over N is one cycle's cost:
#   raw      `SET NX PX` + a compare-and-delete script
#   scripts  lua/acquire.lua + lua/release_sharded.lua, as the Cluster
#            backend sends them (the single node's release.lua differs only
#            in PUBLISH for SPUBLISH)
#
#   bash lock-redis/examples/script_instructions.sh [raw|scripts ...]
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "valgrind is needed" >&2; exit 69; }
kinds=("$@")
[ ${#kinds[@]} -gt 0 ] || kinds=(raw scripts)
# shellcheck source=callgrind_server.sh
. examples/callgrind_server.sh

cat >"$work/drive.py" <<'PY'
import hashlib, socket, sys
port, kind, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
conn = socket.create_connection(("127.0.0.1", port))
replies = conn.makefile("rb")

def command(*args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)

def reply():
    line = replies.readline()
    if line[:1] == b"-":
        sys.exit("error reply: %r" % line)
    if line[:1] == b"$" and int(line[1:]) >= 0:
        replies.read(int(line[1:]) + 2)
    if line[:1] == b"*":
        for _ in range(int(line[1:])):
            reply()

def load(body):
    conn.sendall(command("SCRIPT", "LOAD", body))
    reply()
    return hashlib.sha1(body).hexdigest()

owner = "node/0123456789abcdef0123456789abcdef"
if kind == "raw":
    release = load(b"if redis.call('GET', KEYS[1]) == ARGV[1] then "
                   b"return redis.call('DEL', KEYS[1]) end return 0")
else:
    acquire = load(open("lua/acquire.lua", "rb").read())
    release = load(open("lua/release_sharded.lua", "rb").read())
done = 0
while done < n:
    batch = []
    for i in range(done, min(n, done + 500)):
        key, fence, channel = "{k%d}" % i, "{k%d}:withlock-fence:{k%d}" % (i, i), "{k%d}:released" % i
        if kind == "raw":
            batch.append(command("SET", key, owner, "NX", "PX", 30000))
            batch.append(command("EVALSHA", release, 1, key, owner))
        else:
            batch.append(command("EVALSHA", acquire, 2, key, fence, owner, 30000, 30000 + 604800000))
            batch.append(command("EVALSHA", release, 1, key, owner, channel))
    conn.sendall(b"".join(batch))
    for _ in batch:
        reply()
    done += len(batch) // 2
PY


count() {
  local kind=$1 n=$2
  start_server "$work/server.$kind.$n"
  python3 "$work/drive.py" "$port" "$kind" "$n"
  stop_server
  total "$work/server.$kind.$n"
}

printf '%-8s %22s\n' kind "server instr/cycle"
for kind in "${kinds[@]}"; do
  base=$(count "$kind" 0)
  full=$(count "$kind" 10000)
  printf '%-8s %22d\n' "$kind" $(((full - base) / 10000))
done
