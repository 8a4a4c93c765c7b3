#!/usr/bin/env bash
# run-local.sh runs the coordinator for development (`make run`).
#
# With DATABASE_URL set it only runs the coordinator. Otherwise it keeps a
# durable PostgreSQL cluster under .data/ (created on first use, kept between
# runs), starts it on 127.0.0.1:${IDEMCOORD_PG_PORT:-54329}, creates the
# database "idemcoord" if missing and runs the coordinator against it in the
# foreground. Ctrl-C (or SIGTERM) stops the coordinator, then PostgreSQL.
#
# Environment:
#   DATABASE_URL        use this database; start no cluster
#   IDEMCOORD_BIN       coordinator binary (default bin/idemcoord)
#   IDEMCOORD_PG_PORT   port of the local cluster (default 54329)
#   PG_BIN              directory of the PostgreSQL server binaries (default:
#                       newest /usr/lib/postgresql/*/bin, else PATH)
# Arguments are passed to the coordinator.
set -euo pipefail

cd "$(dirname "$0")/.."
root=$(pwd -P)
bin=${IDEMCOORD_BIN:-bin/idemcoord}

if [[ -n ${DATABASE_URL:-} ]]; then
	exec "$bin" "$@"
fi

say() { echo "run-local: $*" >&2; }
die() { say "$*"; exit 1; }

[[ -x $bin ]] || die "no coordinator binary at $bin (run 'make build', or set IDEMCOORD_BIN)"

# shellcheck source=lib/pgnode.sh
source "$root/scripts/lib/pgnode.sh"
pgnode_find_bin
pgnode_as_postgres

port=${IDEMCOORD_PG_PORT:-54329}
data=$root/.data/pg        # the cluster
run=$root/.data/run        # its Unix socket and the owner file
logdir=$root/.data/log     # its server log
log=$logdir/postgres.log
owner_file=$run/run-local.pid # PID of the run-local.sh that started the server

mkdir -p "$root/.data"
chmod 0755 "$root/.data"
pgnode_prepare "$data" "$run" "$logdir"
pgnode_init "$data" "$logdir"

# stop_pg is set when this run owns the server and stops it on exit.
stop_pg=0
if pid=$(pgnode_running "$data"); then
	owner=$(cat "$owner_file" 2>/dev/null || true)
	if [[ -n $owner && $owner != "$$" ]] && kill -0 "$owner" 2>/dev/null; then
		say "PostgreSQL (PID $pid) is already running for run-local.sh PID $owner; sharing it, leaving it running"
	else
		say "PostgreSQL (PID $pid) was left running by an earlier run; adopting it"
		echo $$ >"$owner_file"
		stop_pg=1
	fi
	# Use the port it actually listens on.
	port=$(pgnode_port "$data")
else
	pgnode_clear_stale_locks "$data" "$run"
	echo $$ >"$owner_file"
	pgnode_start "$data" "$run" "$log" "$port"
	stop_pg=1
fi

child=
cleanup() {
	trap - INT TERM EXIT
	if [[ -n $child ]]; then
		pgnode_stop_process "$child"
	fi
	if [[ $stop_pg == 1 ]]; then
		pgnode_stop "$data" "$log"
		rm -f "$owner_file"
	fi
}
trap 'cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM
trap cleanup EXIT

"$pgbin/psql" -X -q -h 127.0.0.1 -p "$port" -U postgres -d postgres -v ON_ERROR_STOP=1 <<'SQL' >/dev/null
SELECT 'CREATE DATABASE idemcoord' WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = 'idemcoord')
\gexec
SQL

export DATABASE_URL="postgres://postgres@127.0.0.1:$port/idemcoord?sslmode=disable"
coordinator_addrs "$@"
say "PostgreSQL data in $data (log $log); DATABASE_URL=$DATABASE_URL; coordinator gRPC $grpc_addr, metrics/health http://$http_addr"

# In the background so that the traps run as soon as a signal arrives.
"$bin" "$@" &
child=$!
status=0
wait "$child" || status=$?
child=
exit "$status"
