#!/usr/bin/env bash
# run-ha.sh runs the coordinator on a local high-availability PostgreSQL
# (`make run-ha`): a pg_auto_failover monitor and three data nodes on
# loopback ports, one primary and two standbys of which one must confirm
# every commit (number_sync_standbys = 1), with durable settings (fsync,
# synchronous_commit, full_page_writes on). The data lives under .data-ha/
# and is kept between runs. The coordinator runs in the foreground on the
# multi-host URL of the three nodes (target_session_attrs=read-write), so it
# follows a failover by itself. Ctrl-C (or SIGTERM) stops the coordinator,
# the data nodes and the monitor.
#
# Try a failover from another terminal while it runs:
#   scripts/run-ha.sh failover     (pg_autoctl perform failover)
#   scripts/run-ha.sh state        (pg_autoctl show state)
# `scripts/run-ha.sh cluster` starts the cluster without a coordinator,
# prints "run-ha: cluster ready: DATABASE_URL=…" and runs until signalled
# (the long failover test in chaos/ uses it).
#
# Environment:
#   IDEMCOORD_BIN        coordinator binary (default bin/idemcoord)
#   IDEMCOORD_HA_PORT    port of the monitor (default 55430); the data nodes
#                        use the next three ports
#   IDEMCOORD_HA_DIR     data directory (default .data-ha)
#   PG_BIN               directory of the PostgreSQL server binaries (default:
#                        newest /usr/lib/postgresql/*/bin)
# Needs pg_autoctl (Debian: postgresql-15-auto-failover, pg-auto-failover-cli).
# Arguments are passed to the coordinator.
set -euo pipefail

cd "$(dirname "$0")/.."
root=$(pwd -P)
bin=${IDEMCOORD_BIN:-bin/idemcoord}
base=${IDEMCOORD_HA_PORT:-55430}
ha=${IDEMCOORD_HA_DIR:-$root/.data-ha}

say() { echo "run-ha: $*" >&2; }
die() { say "$*"; exit 1; }
# shellcheck source=lib/pgnode.sh
source "$root/scripts/lib/pgnode.sh"

pgbin=${PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -t/ -k5,5n | tail -n 1 || true)}
[[ -n $pgbin && -x $pgbin/pg_ctl ]] || die "no PostgreSQL server binaries found (PG_BIN, /usr/lib/postgresql/*/bin)"
command -v pg_autoctl >/dev/null ||
	die "no pg_autoctl: install pg_auto_failover (Debian: apt-get install postgresql-15-auto-failover pg-auto-failover-cli)"

# As root, PostgreSQL and pg_autoctl run as the postgres user.
as_pg=()
if [[ $(id -u) == 0 ]]; then
	id postgres >/dev/null 2>&1 || die "running as root needs a 'postgres' system user (apt-get install postgresql)"
	as_pg=(runuser -u postgres --)
fi
# pg_autoctl keeps its configuration and state under XDG directories, and
# its Unix sockets go where PG_REGRESS_SOCK_DIR says: all under .data-ha/.
autoctl() {
	"${as_pg[@]}" env XDG_CONFIG_HOME="$ha/config" XDG_DATA_HOME="$ha/share" XDG_RUNTIME_DIR="$ha/run" \
		PG_REGRESS_SOCK_DIR="$ha/run" PGHOST="$ha/run" PG_CONFIG="$pgbin/pg_config" PATH="$pgbin:$PATH" pg_autoctl "$@"
}

monitor_uri="postgres://autoctl_node@127.0.0.1:$base/pg_auto_failover?sslmode=disable"

# wait_for DESCRIPTION COMMAND... polls until COMMAND succeeds (3 minutes).
wait_for() {
	local what=$1
	shift
	for _ in $(seq 900); do
		"$@" >/dev/null 2>&1 && return 0
		sleep 0.2
	done
	die "timed out waiting for $what (logs in $ha/log/)"
}

monitor_sql() {
	"$pgbin/psql" -X -qAt -h 127.0.0.1 -p "$base" -U autoctl_node -d pg_auto_failover -c "$1"
}

# monitor_true SQL succeeds when SQL, run on the monitor, answers 1 (psql
# itself succeeds on an answer of no rows).
monitor_true() {
	[[ $(monitor_sql "$1") == 1 ]]
}

# A settled formation: one primary and two secondaries, each in the state
# the monitor assigned it.
settled_sql="SELECT 1 FROM pgautofailover.node HAVING count(*) FILTER (WHERE reportedstate = 'primary' AND goalstate = 'primary') = 1
	AND count(*) FILTER (WHERE reportedstate = 'secondary' AND goalstate = 'secondary') = 2"

case ${1:-} in
failover)
	# The monitor refuses a failover while the formation is in transition
	# (a node catching up, the previous failover finishing): wait until it
	# has settled, and once more should it refuse anyway.
	for attempt in 1 2 3; do
		wait_for "a settled formation" monitor_true "$settled_sql"
		autoctl perform failover --monitor "$monitor_uri" && exit 0
		say "pg_autoctl perform failover failed (attempt $attempt of 3)"
		sleep 1
	done
	die "pg_autoctl perform failover failed 3 times"
	;;
state)
	autoctl show state --monitor "$monitor_uri"
	exit
	;;
esac

cluster_only=0
if [[ ${1:-} == cluster ]]; then
	cluster_only=1
	shift
fi
[[ $cluster_only == 1 || -x $bin ]] || die "no coordinator binary at $bin (run 'make build', or set IDEMCOORD_BIN)"

mkdir -p "$ha/config" "$ha/share" "$ha/run" "$ha/log"
chmod 0755 "$ha"
chmod 0700 "$ha/run"
[[ ${#as_pg[@]} -eq 0 ]] || chown -R postgres: "$ha"

pids=()
child=
cleanup() {
	trap - INT TERM EXIT
	if [[ -n $child ]] && kill -0 "$child" 2>/dev/null; then
		kill -TERM "$child" 2>/dev/null || true
		wait "$child" 2>/dev/null || true
	fi
	# Data nodes first, then the monitor: "pg_autoctl stop" signals the
	# node's supervisor, which stops its PostgreSQL.
	for name in node3 node2 node1 monitor; do
		[[ -f $ha/$name/PG_VERSION ]] && autoctl stop --pgdata "$ha/$name" >/dev/null 2>&1 || true
	done
	for pid in "${pids[@]}"; do
		for _ in $(seq 600); do # 60 s, then SIGKILL
			kill -0 "$pid" 2>/dev/null || break
			sleep 0.1
		done
		kill -KILL "$pid" 2>/dev/null || true
		wait "$pid" 2>/dev/null || true
	done
	say "stopped"
}
trap 'cleanup; exit 130' INT
trap 'cleanup; exit 143' TERM
trap cleanup EXIT

# start NAME ARGS... creates the node on first use and runs it in the
# background ("pg_autoctl run" supervises its PostgreSQL).
start() {
	local name=$1
	shift
	local pgdata=$ha/$name
	if [[ ! -f $pgdata/PG_VERSION ]]; then
		say "creating $name"
		autoctl "$@" --pgdata "$pgdata" >>"$ha/log/$name.log" 2>&1 ||
			{ tail -n 30 "$ha/log/$name.log" >&2; die "pg_autoctl create $name failed (log: $ha/log/$name.log)"; }
		# Loopback only (the monitor has no --listen option).
		autoctl config set --pgdata "$pgdata" postgresql.listen_addresses 127.0.0.1 >>"$ha/log/$name.log" 2>&1
	fi
	autoctl run --pgdata "$pgdata" >>"$ha/log/$name.log" 2>&1 &
	pids+=($!)
}

common=(--auth trust --no-ssl --hostname 127.0.0.1 --pgctl "$pgbin/pg_ctl")
start monitor create monitor --pgport "$base" "${common[@]}"
wait_for "the monitor" monitor_sql "SELECT 1"

for n in 1 2 3; do
	start "node$n" create postgres --pgport $((base + n)) --name "node$n" --dbname idemcoord \
		--listen 127.0.0.1 --monitor "$monitor_uri" "${common[@]}"
	# One node at a time: each new one clones the primary.
	wait_for "node$n to join" monitor_true \
		"SELECT 1 FROM pgautofailover.node WHERE nodename = 'node$n' AND reportedstate IN ('primary', 'secondary', 'single') AND reportedstate = goalstate"
done

# One standby must confirm every commit before the primary acknowledges it.
wait_for "number_sync_standbys = 1" autoctl set formation number-sync-standbys 1 --monitor "$monitor_uri"
wait_for "one primary and two secondaries" monitor_true "$settled_sql"

export DATABASE_URL="postgres://postgres@127.0.0.1:$((base + 1)),127.0.0.1:$((base + 2)),127.0.0.1:$((base + 3))/idemcoord?sslmode=disable&target_session_attrs=read-write"
# The primary takes writes and keeps PostgreSQL's durable defaults.
durable() {
	[[ $("$pgbin/psql" -X -qAt -d "$DATABASE_URL" -c \
		"SELECT current_setting('fsync') || current_setting('synchronous_commit') || current_setting('full_page_writes') || NOT pg_is_in_recovery()") == ononontrue ]]
}
wait_for "the primary to take writes" durable
autoctl show state --monitor "$monitor_uri" >&2 || true
say "data in $ha (logs $ha/log/); DATABASE_URL=$DATABASE_URL"
if [[ $cluster_only == 1 ]]; then
	say "cluster ready: DATABASE_URL=$DATABASE_URL"
	while true; do sleep 1; done
fi
coordinator_addrs "$@"
say "coordinator gRPC $grpc_addr, metrics/health http://$http_addr; 'scripts/run-ha.sh failover' in another terminal fails over"

"$bin" "$@" &
child=$!
status=0
wait "$child" || status=$?
child=
exit "$status"
