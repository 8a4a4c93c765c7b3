# pgnode.sh: functions for scripts that keep a durable local PostgreSQL
# server (a "node": data directory, socket directory, log) for development;
# sourced by run-local.sh (one node) and run-citus.sh (a Citus coordinator
# node and its workers). The sourcing script defines say and die.
#
#   pgnode_find_bin        sets pgbin: PG_BIN, else the newest
#                          /usr/lib/postgresql/*/bin, else the initdb on PATH
#   pgnode_as_postgres     sets as_pg: as root, PostgreSQL runs as the
#                          postgres user (runuser); pg CMD... runs CMD so
#   pgnode_prepare D R L   creates data dir D, socket dir R (one per node)
#                          and log dir L
#   pgnode_init D L        initdb D once (its output in L/initdb.log)
#   pgnode_running D       prints the PID of the postmaster serving D
#   pgnode_clear_stale_locks D R   removes lock files of a gone postmaster
#   pgnode_start D R LOG PORT [SETTING...]   starts a durable server
#   pgnode_stop D LOG      fast shutdown
#   pgnode_stop_process PID   SIGTERM, then SIGKILL after 30 s; waits for it
#   coordinator_addrs ARG...   sets grpc_addr and http_addr: where the
#                          coordinator run with ARG... listens (its last
#                          --listen/--http-listen, else IDEMCOORD_LISTEN and
#                          IDEMCOORD_HTTP_LISTEN, else the defaults)

pgnode_find_bin() {
	pgbin=${PG_BIN:-}
	if [[ -z $pgbin ]]; then
		pgbin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -t/ -k5,5n | tail -n 1 || true)
	fi
	if [[ -z $pgbin ]] && command -v initdb >/dev/null; then
		pgbin=$(dirname "$(command -v initdb)")
	fi
	[[ -n $pgbin && -x $pgbin/initdb && -x $pgbin/pg_ctl ]] ||
		die "no PostgreSQL server binaries found (PG_BIN, /usr/lib/postgresql/*/bin, PATH): install them (Debian: apt-get install postgresql) or set DATABASE_URL"
}

pgnode_as_postgres() {
	as_pg=()
	if [[ $(id -u) == 0 ]]; then
		id postgres >/dev/null 2>&1 || die "running as root needs a 'postgres' system user (apt-get install postgresql)"
		as_pg=(runuser -u postgres --)
	fi
}

pg() { "${as_pg[@]}" "$@"; }

pgnode_prepare() {
	local data=$1 run=$2 logdir=$3
	mkdir -p "$data" "$run" "$logdir"
	chmod 0755 "$run" "$logdir"
	chmod 0700 "$data"
	if [[ ${#as_pg[@]} -gt 0 ]]; then
		chown postgres: "$data" "$run" "$logdir"
		pg test -x "$data" -a -w "$run" ||
			die "the postgres user cannot reach $data: make the directories above it traversable (chmod o+x), or set DATABASE_URL"
	fi
}

pgnode_init() {
	local data=$1 logdir=$2
	[[ -f $data/PG_VERSION ]] && return 0
	say "creating a PostgreSQL cluster in $data"
	pg "$pgbin/initdb" -D "$data" -U postgres -A trust -E UTF8 --locale=C --no-instructions >"$logdir/initdb.log" 2>&1 ||
		{ cat "$logdir/initdb.log" >&2; die "initdb failed"; }
}

# pgnode_is_postgres reports whether PID $1 is a live (not zombie)
# PostgreSQL process.
pgnode_is_postgres() {
	[[ $1 =~ ^[0-9]+$ && -r /proc/$1/status ]] &&
		[[ $(cat "/proc/$1/comm" 2>/dev/null) == postgres ]] &&
		! grep -q '^State:[[:space:]]*Z' "/proc/$1/status" 2>/dev/null
}

pgnode_running() {
	local data=$1 pid
	[[ -f $data/postmaster.pid ]] || return 1
	pid=$(head -n 1 "$data/postmaster.pid")
	pgnode_is_postgres "$pid" || return 1
	echo "$pid"
}

# pgnode_port prints the port the running postmaster of $1 listens on.
pgnode_port() { sed -n 4p "$1/postmaster.pid"; }

# pgnode_clear_stale_locks removes lock files left by a postmaster that is
# gone. PostgreSQL replaces them itself unless their PID now belongs to
# another process (after a reboot) or to an unreaped zombie; then it
# refuses to start. Server processes that outlived their postmaster still
# use the data directory, so then it refuses too.
pgnode_clear_stale_locks() {
	local data=$1 run=$2 f pid p
	for p in /proc/[0-9]*; do
		if [[ $(readlink "$p/cwd" 2>/dev/null) == "$data" ]] && pgnode_is_postgres "${p#/proc/}"; then
			die "PostgreSQL processes without a postmaster still use $data (PID ${p#/proc/}); stop them first"
		fi
	done
	for f in "$data/postmaster.pid" "$run"/.s.PGSQL.*.lock; do
		[[ -f $f ]] || continue
		pid=$(head -n 1 "$f")
		pgnode_is_postgres "$pid" && die "$f names PostgreSQL PID $pid, which does not serve $data; stop it first"
		say "removing stale $f (PID $pid is not a running PostgreSQL)"
		rm -f "$f"
	done
}

# pgnode_start starts a durable server (fsync, synchronous_commit and
# full_page_writes on) on 127.0.0.1:PORT; extra arguments are settings
# (name=value).
pgnode_start() {
	local data=$1 run=$2 log=$3 port=$4 s opts
	shift 4
	opts="-p $port -k '$run' -c listen_addresses=127.0.0.1 -c max_connections=200 -c fsync=on -c synchronous_commit=on -c full_page_writes=on"
	for s in "$@"; do
		opts+=" -c $s"
	done
	if ! pg "$pgbin/pg_ctl" start -w -t 60 -D "$data" -l "$log" -o "$opts" >/dev/null; then
		tail -n 20 "$log" >&2
		die "PostgreSQL did not start (log: $log)"
	fi
}

pgnode_stop() {
	local data=$1 log=$2
	pg "$pgbin/pg_ctl" stop -w -D "$data" -m fast >/dev/null || say "could not stop PostgreSQL in $data (log: $log)"
}

pgnode_stop_process() {
	local pid=$1
	kill -0 "$pid" 2>/dev/null || return 0
	kill -TERM "$pid" 2>/dev/null || true
	for _ in $(seq 300); do # 30 s, then SIGKILL
		kill -0 "$pid" 2>/dev/null || break
		sleep 0.1
	done
	kill -KILL "$pid" 2>/dev/null || true
	wait "$pid" 2>/dev/null || true
}

coordinator_addrs() {
	grpc_addr=${IDEMCOORD_LISTEN:-127.0.0.1:50051}
	http_addr=${IDEMCOORD_HTTP_LISTEN:-127.0.0.1:9090}
	while (($#)); do
		case $1 in
		--listen=* | -listen=*) grpc_addr=${1#*=} ;;
		--http-listen=* | -http-listen=*) http_addr=${1#*=} ;;
		--listen | -listen | --http-listen | -http-listen)
			if (($# >= 2)); then
				case $1 in
				*http*) http_addr=$2 ;;
				*) grpc_addr=$2 ;;
				esac
				shift
			fi
			;;
		esac
		shift
	done
}
