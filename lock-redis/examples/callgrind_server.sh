# Sourced by server_instructions.sh and script_instructions.sh: a private
# redis-server on a free loopback port under callgrind. Makes the scratch
# directory $work, sets $server_pid and $port, and on exit kills the
# server and removes $work.

work=$(mktemp -d)
server_pid=
cleanup() {
  if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

# The instruction total of a callgrind output file.
total() { callgrind_annotate "$1" 2>/dev/null | awk '/PROGRAM TOTALS/ { gsub(",", "", $1); print $1 }'; }

# Starts the server, counting into $1, and waits until it answers.
start_server() {
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  valgrind --tool=callgrind --callgrind-out-file="$1" \
    redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no >"$work/server.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 1 100); do
    redis-cli -p "$port" ping >/dev/null 2>&1 && break
    sleep 0.1
  done
}

# Stops it; its count is then complete.
stop_server() {
  redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
  wait "$server_pid" 2>/dev/null || true
  server_pid=
}
