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

# PostgreSQL server binaries: PG_BIN, else the newest Debian install, else PATH.
pgbin=${PG_BIN:-}
if [[ -z $pgbin ]]; then
	pgbin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -t/ -k5,5n | tail -n 1 || true)
fi
if [[ -z $pgbin ]] && command -v initdb >/dev/null; then
	pgbin=$(dirname "$(command -v initdb)")
fi
[[ -n $pgbin && -x $pgbin/initdb && -x $pgbin/pg_ctl ]] ||
	die "no PostgreSQL server binaries found (PG_BIN, /usr/lib/postgresql/*/bin, PATH): install them (Debian: apt-get install postgresql) or set DATABASE_URL"

port=${IDEMCOORD_PG_PORT:-54329}
data=$root/.data/pg        # the cluster
run=$root/.data/run        # its Unix socket and the owner file
logdir=$root/.data/log     # its server log
log=$logdir/postgres.log
owner_file=$run/run-local.pid # PID of the run-local.sh that started the server

# As root, PostgreSQL runs as the postgres user, which must own its
# directories and be able to reach them.
as_pg=()
if [[ $(id -u) == 0 ]]; then
	id postgres >/dev/null 2>&1 || die "running as root needs a 'postgres' system user (apt-get install postgresql)"
	as_pg=(runuser -u postgres --)
fi
pg() { "${as_pg[@]}" "$@"; }

mkdir -p "$root/.data" "$data" "$run" "$logdir"
chmod 0755 "$root/.data" "$run" "$logdir"
chmod 0700 "$data"
if [[ ${#as_pg[@]} -gt 0 ]]; then
	chown postgres: "$data" "$run" "$logdir"
	pg test -x "$data" -a -w "$run" ||
		die "the postgres user cannot reach $root/.data: make the directories above it traversable (chmod o+x), or set DATABASE_URL"
fi

if [[ ! -f $data/PG_VERSION ]]; then
	say "creating a PostgreSQL cluster in $data"
	pg "$pgbin/initdb" -D "$data" -U postgres -A trust -E UTF8 --locale=C --no-instructions >"$logdir/initdb.log" 2>&1 ||
		{ cat "$logdir/initdb.log" >&2; die "initdb failed"; }
fi

# is_postgres reports whether PID $1 is a live (not zombie) PostgreSQL process.
is_postgres() {
	[[ $1 =~ ^[0-9]+$ && -r /proc/$1/status ]] &&
		[[ $(cat "/proc/$1/comm" 2>/dev/null) == postgres ]] &&
		! grep -q '^State:[[:space:]]*Z' "/proc/$1/status" 2>/dev/null
}

# running prints the PID of the postmaster that serves $data, if one does.
running() {
	local pid
	[[ -f $data/postmaster.pid ]] || return 1
	pid=$(head -n 1 "$data/postmaster.pid")
	is_postgres "$pid" || return 1
	echo "$pid"
}

# clear_stale_locks removes lock files left by a postmaster that is gone.
# PostgreSQL replaces them itself unless their PID now belongs to another
# process (after a reboot) or to an unreaped zombie; then it refuses to start.
# Server processes that outlived their postmaster still use the data
# directory, so then it refuses too.
clear_stale_locks() {
	local f pid p
	for p in /proc/[0-9]*; do
		if [[ $(readlink "$p/cwd" 2>/dev/null) == "$data" ]] && is_postgres "${p#/proc/}"; then
			die "PostgreSQL processes without a postmaster still use $data (PID ${p#/proc/}); stop them first"
		fi
	done
	for f in "$data/postmaster.pid" "$run"/.s.PGSQL.*.lock; do
		[[ -f $f ]] || continue
		pid=$(head -n 1 "$f")
		is_postgres "$pid" && die "$f names PostgreSQL PID $pid, which does not serve $data; stop it first"
		say "removing stale $f (PID $pid is not a running PostgreSQL)"
		rm -f "$f"
	done
}

# stop_pg is set when this run owns the server and stops it on exit.
stop_pg=0
if pid=$(running); then
	owner=$(cat "$owner_file" 2>/dev/null || true)
	if [[ -n $owner && $owner != "$$" ]] && kill -0 "$owner" 2>/dev/null; then
		say "PostgreSQL (PID $pid) is already running for run-local.sh PID $owner; sharing it, leaving it running"
	else
		say "PostgreSQL (PID $pid) was left running by an earlier run; adopting it"
		echo $$ >"$owner_file"
		stop_pg=1
	fi
	# Use the port it actually listens on.
	port=$(sed -n 4p "$data/postmaster.pid")
else
	clear_stale_locks
	echo $$ >"$owner_file"
	if ! pg "$pgbin/pg_ctl" start -w -t 60 -D "$data" -l "$log" -o "-p $port -k '$run' \
		-c listen_addresses=127.0.0.1 -c max_connections=200 \
		-c fsync=on -c synchronous_commit=on -c full_page_writes=on" >/dev/null; then
		tail -n 20 "$log" >&2
		die "PostgreSQL did not start (log: $log)"
	fi
	stop_pg=1
fi

child=
cleanup() {
	trap - INT TERM EXIT
	if [[ -n $child ]] && kill -0 "$child" 2>/dev/null; then
		kill -TERM "$child" 2>/dev/null || true
		for _ in $(seq 300); do # 30 s, then SIGKILL
			kill -0 "$child" 2>/dev/null || break
			sleep 0.1
		done
		kill -KILL "$child" 2>/dev/null || true
		wait "$child" 2>/dev/null || true
	fi
	if [[ $stop_pg == 1 ]]; then
		pg "$pgbin/pg_ctl" stop -w -D "$data" -m fast >/dev/null || say "could not stop PostgreSQL (log: $log)"
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
say "PostgreSQL data in $data (log $log); DATABASE_URL=$DATABASE_URL; coordinator gRPC ${IDEMCOORD_LISTEN:-127.0.0.1:50051}, metrics/health http://${IDEMCOORD_HTTP_LISTEN:-127.0.0.1:9090}"

# In the background so that the traps run as soon as a signal arrives.
"$bin" "$@" &
child=$!
status=0
wait "$child" || status=$?
child=
exit "$status"
