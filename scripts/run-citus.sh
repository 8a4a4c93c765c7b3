#!/usr/bin/env bash
# run-citus.sh runs the coordinator on a local Citus cluster (`make run-citus`):
# a Citus coordinator node and two workers, each a durable PostgreSQL
# (fsync, synchronous_commit, full_page_writes on) with the citus library
# preloaded, on loopback ports. The data lives under .data/citus/ and is
# kept between runs. On each node the database "idemcoord" has the citus
# extension, and the workers are registered with the coordinator node
# (citus_add_node); the coordinator's migrations then distribute the
# records over the workers. The coordinator runs in the foreground against
# the coordinator node. Ctrl-C (or SIGTERM) stops the coordinator, then
# the three nodes.
#
# Environment:
#   IDEMCOORD_BIN                coordinator binary (default bin/idemcoord)
#   IDEMCOORD_CITUS_PORT         port of the coordinator node (default 54330)
#   IDEMCOORD_CITUS_WORKER_PORTS ports of the two workers (default the next
#                                two). The workers' ports are recorded in
#                                the cluster's metadata: keep them between
#                                runs (or make clean-data).
#   PG_BIN                       directory of the PostgreSQL server binaries
#                                (default: newest /usr/lib/postgresql/*/bin)
# Needs the citus extension installed into that PostgreSQL
# (../shared/citus/build.sh builds and installs it; .ci/run runs it).
# Arguments are passed to the coordinator.
set -euo pipefail

cd "$(dirname "$0")/.."
root=$(pwd -P)
bin=${IDEMCOORD_BIN:-bin/idemcoord}

say() { echo "run-citus: $*" >&2; }
die() { say "$*"; exit 1; }

[[ -x $bin ]] || die "no coordinator binary at $bin (run 'make build', or set IDEMCOORD_BIN)"

# shellcheck source=lib/pgnode.sh
source "$root/scripts/lib/pgnode.sh"
pgnode_find_bin
pgnode_as_postgres

[[ -f $("$pgbin/pg_config" --pkglibdir)/citus.so && -f $("$pgbin/pg_config" --sharedir)/extension/citus.control ]] ||
	die "the citus extension is not installed into the PostgreSQL at $pgbin: build and install it with ../shared/citus/build.sh (as root)"

base=${IDEMCOORD_CITUS_PORT:-54330}
read -r -a worker_ports <<<"${IDEMCOORD_CITUS_WORKER_PORTS:-$((base + 1)) $((base + 2))}"
((${#worker_ports[@]} == 2)) || die "IDEMCOORD_CITUS_WORKER_PORTS must name two ports"
names=(coordinator worker1 worker2)
ports=("$base" "${worker_ports[@]}")
dir=$root/.data/citus
owner_file=$dir/run-citus.pid # PID of the run-citus.sh that started the nodes

mkdir -p "$root/.data" "$dir"
chmod 0755 "$root/.data" "$dir"

# The nodes: each has .data/citus/<name>/{pg,run,log}.
data_of() { echo "$dir/$1/pg"; }
run_of() { echo "$dir/$1/run"; }
log_of() { echo "$dir/$1/log/postgres.log"; }

# Nodes this run started or adopted, stopped on exit.
owned=()
owner=$(cat "$owner_file" 2>/dev/null || true)
sharing=0
if [[ -n $owner && $owner != "$$" ]] && kill -0 "$owner" 2>/dev/null; then
	sharing=1
	say "the Citus cluster is already running for run-citus.sh PID $owner; sharing it, leaving it running"
else
	echo $$ >"$owner_file"
fi

for i in "${!names[@]}"; do
	n=${names[$i]}
	data=$(data_of "$n")
	mkdir -p "$dir/$n"
	chmod 0755 "$dir/$n"
	pgnode_prepare "$data" "$(run_of "$n")" "$dir/$n/log"
	pgnode_init "$data" "$dir/$n/log"
	if pid=$(pgnode_running "$data"); then
		ports[i]=$(pgnode_port "$data")
		if [[ $sharing == 0 ]]; then
			say "$n (PID $pid) was left running by an earlier run; adopting it"
			owned+=("$n")
		fi
	else
		[[ $sharing == 0 ]] || die "$n is not running although run-citus.sh PID $owner is; stop that one first"
		pgnode_clear_stale_locks "$data" "$(run_of "$n")"
		pgnode_start "$data" "$(run_of "$n")" "$(log_of "$n")" "${ports[$i]}" shared_preload_libraries=citus
		owned+=("$n")
	fi
done

base=${ports[0]}
worker_ports=("${ports[1]}" "${ports[2]}")

child=
cleanup() {
	trap - INT TERM EXIT
	if [[ -n $child ]]; then
		pgnode_stop_process "$child"
	fi
	local n
	for n in "${owned[@]}"; do
		pgnode_stop "$(data_of "$n")" "$(log_of "$n")"
	done
	if [[ $sharing == 0 ]]; then
		rm -f "$owner_file"
	fi
}
trap 'cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM
trap cleanup EXIT

psql_on() {
	local port=$1 db=$2
	shift 2
	PGOPTIONS="-c client_min_messages=warning" "$pgbin/psql" -X -q -h 127.0.0.1 -p "$port" -U postgres -d "$db" -v ON_ERROR_STOP=1 "$@"
}

# The database and the extension on every node, the workers' first: the
# coordinator node reaches them when they are registered.
for port in "${worker_ports[@]}" "$base"; do
	psql_on "$port" postgres >/dev/null <<'SQL'
SELECT 'CREATE DATABASE idemcoord' WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = 'idemcoord')
\gexec
SQL
	psql_on "$port" idemcoord -c 'CREATE EXTENSION IF NOT EXISTS citus' >/dev/null
done
# Register the coordinator node and the workers (once; citus_add_node
# takes a worker already registered as a no-op).
psql_on "$base" idemcoord -v cport="$base" -v w1="${worker_ports[0]}" -v w2="${worker_ports[1]}" >/dev/null <<'SQL'
SELECT citus_set_coordinator_host('127.0.0.1', :cport) WHERE NOT EXISTS (SELECT FROM pg_dist_node WHERE groupid = 0);
SELECT citus_add_node('127.0.0.1', :w1);
SELECT citus_add_node('127.0.0.1', :w2);
SQL

export DATABASE_URL="postgres://postgres@127.0.0.1:$base/idemcoord?sslmode=disable"
say "Citus: coordinator node 127.0.0.1:$base, workers 127.0.0.1:${worker_ports[0]} and 127.0.0.1:${worker_ports[1]} (data and logs in $dir)"
coordinator_addrs "$@"
say "DATABASE_URL=$DATABASE_URL; coordinator gRPC $grpc_addr, metrics/health http://$http_addr"

# In the background so that the traps run as soon as a signal arrives.
"$bin" "$@" &
child=$!
status=0
wait "$child" || status=$?
child=
exit "$status"
