#!/usr/bin/env bash
# scripts/mutants.sh (make mutants): plants each bug of a fixed list, one at
# a time, in a throwaway copy of the working tree, runs the tests that must
# notice it, and counts the bugs they caught (killed) against those they
# missed (survived). It exits non-zero when a bug survives, when a planted
# pattern is not found (the code moved: update the list), or when the tests
# fail before any bug is planted.
#
# The list holds bugs found by hand in review (a spec bug in
# statemachine.Next, FOR UPDATE removed, fsync and synchronous commit off,
# attempt_id renewal dropped, reaper bugs, config promises), each with the
# narrowest test command that should catch it, so a run takes minutes, not
# hours. Statemachine spec bugs are run against the chaos reference model
# only (not statemachine's own tests), to show that the model is
# independent of the code under test.
#
#   MUTANTS=name1,name2  run only those mutants
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/idemcoord-mutants-XXXXXX")
trap 'rm -rf "$work"' EXIT
# The working tree as it is (tracked and new files, not ignored ones).
(cd "$root" && git ls-files -co --exclude-standard -z | xargs -0 tar cf - 2>/dev/null) | tar xf - -C "$work"
cd "$work"
export GOFLAGS="${GOFLAGS:-} -count=1"

ref='go test ./chaos -run ^TestLinearizableReference$'
power='go test ./chaos -run ^TestPowerLoss$'

killed=0 survived=0 broken=0
results=()

# The tests must pass before any bug is planted, or a "kill" means nothing.
if [[ -z ${MUTANTS_SKIP_BASELINE:-} ]]; then
	for cmd in "$ref" "$power" 'go test -race ./ledger -run ^TestLockedPathHasOneWinner$' \
		"go test ./server -run '^(TestConfigRejectsUnknownKeys|TestFirstMatchingPolicyWins)\$'" \
		'go test ./clients -run ^TestInterceptorErrorClasses$'; do
		echo "=== baseline: $cmd"
		if ! bash -c "$cmd" >"$work/baseline.log" 2>&1; then
			cp "$work/baseline.log" "$root/mutants-baseline.log"
			tail -50 "$work/baseline.log"
			echo "mutants: the tests fail with no bug planted: $cmd (log: $root/mutants-baseline.log)" >&2
			exit 1
		fi
	done
fi

# plant NAME FILE FROM TO: replace the one occurrence of FROM in FILE.
plant() {
	python3 - "$2" "$3" "$4" <<'EOF'
import sys
path, old, new = sys.argv[1], sys.argv[2].encode().decode('unicode_escape'), sys.argv[3].encode().decode('unicode_escape')
s = open(path).read()
n = s.count(old)
if n != 1:
    sys.exit(f"pattern found {n} times in {path}: {old!r}")
open(path, 'w').write(s.replace(old, new))
EOF
}

# mutant NAME FILE FROM TO TEST...: plant the bug, run TEST, restore.
mutant() {
	local name=$1 file=$2 from=$3 to=$4
	shift 4
	if [[ -n ${MUTANTS:-} && ",$MUTANTS," != *",$name,"* ]]; then
		return
	fi
	cp "$file" "$file.orig"
	if ! plant "$name" "$file" "$from" "$to"; then
		broken=$((broken + 1))
		results+=("NOT PLANTED  $name")
		mv "$file.orig" "$file"
		return
	fi
	echo "=== mutant $name: $*"
	local start=$SECONDS
	if bash -c "$*" >"$work/$name.log" 2>&1; then
		survived=$((survived + 1))
		results+=("SURVIVED     $name ($((SECONDS - start))s; log kept: $root/mutants-$name.log)")
		cp "$work/$name.log" "$root/mutants-$name.log"
	else
		killed=$((killed + 1))
		results+=("killed       $name ($((SECONDS - start))s)")
	fi
	mv "$file.orig" "$file"
}

mutant statemachine-takeover-previous-state statemachine/next.go \
	'return takeover(eff, ev, now, StateFailedRetryable, false)' \
	'return takeover(eff, ev, now, StateUnknown, false)' \
	"$ref"
mutant statemachine-max-attempts-off-by-one statemachine/next.go \
	'eff.Attempt >= pol.MaxAttempts' \
	'eff.Attempt > pol.MaxAttempts' \
	"$ref"
mutant statemachine-attempt-id-no-renewal statemachine/next.go \
	'// with a full lease from now.\n\t\t\trec := eff\n\t\t\trec.LeaseExpiresAt = now.Add(ev.Lease)' \
	'// with a full lease from now.\n\t\t\trec := eff' \
	"$ref"
mutant statemachine-abandon-forgets-uncertainty statemachine/next.go \
	'case FailureAbandoned:\n\t\tif rec.Uncertain {' \
	'case FailureAbandoned:\n\t\tif false && rec.Uncertain {' \
	"$ref"
mutant statemachine-reject-refuses-failures statemachine/next.go \
	'if pol.OnExpired == ExpiredReject && !eff.EndedBy.failure(eff.FailureReason) {' \
	'if pol.OnExpired == ExpiredReject {' \
	"$ref"
mutant ledger-no-for-update ledger/store.go \
	'AND key = $3 FOR UPDATE`' \
	'AND key = $3`' \
	'go test -race ./ledger -run ^TestLockedPathHasOneWinner$'
mutant ledger-reaper-stale-early ledger/reaper.go \
	'WHERE state = 1 AND lease_expires_at <= coalesce($1::timestamptz, now())' \
	"WHERE state = 1 AND lease_expires_at <= coalesce(\$1::timestamptz, now()) + interval '1 second'" \
	"$ref"
mutant ledger-reaper-ignores-retention ledger/reaper.go \
	"- \$3 * interval '1 microsecond'" \
	"+ interval '1 hour' - \$3 * interval '1 microsecond'" \
	"$ref"
mutant ledger-synchronous-commit-off ledger/store.go \
	'RuntimeParams["synchronous_commit"] = "on"' \
	'RuntimeParams["synchronous_commit"] = "off"' \
	"$power"
mutant pgtest-durable-fsync-off internal/pgtest/cluster.go \
	'settings = append(settings, c.opts.Settings...)' \
	'settings = append(append(settings, "fsync=off"), c.opts.Settings...)' \
	"$power"
mutant server-config-unknown-keys-accepted server/config.go \
	'dec.KnownFields(true)' \
	'dec.KnownFields(false)' \
	'go test ./server -run ^TestConfigRejectsUnknownKeys$'
mutant server-config-last-match-wins server/config.go \
	'for _, s := range p.scopes {\n\t\tif globMatch(s.match, scope) {' \
	'for i := len(p.scopes) - 1; i >= 0; i-- {\n\t\ts := p.scopes[i]\n\t\tif globMatch(s.match, scope) {' \
	'go test ./server -run ^TestFirstMatchingPolicyWins$'
mutant clients-out-of-range-not-replayable clients/options.go \
	'codes.AlreadyExists: replayable, codes.OutOfRange: replayable,' \
	'codes.AlreadyExists: replayable, codes.OutOfRange: unknown,' \
	'go test ./clients -run ^TestInterceptorErrorClasses$'
mutant clients-aborted-abandoned clients/options.go \
	'codes.Unavailable:   retryable, codes.Aborted: retryable,' \
	'codes.Unavailable:   retryable, codes.Aborted: abandoned,' \
	'go test ./clients -run ^TestInterceptorErrorClasses$'

echo
echo "mutants: planted bugs and the tests that must catch them"
printf '  %s\n' "${results[@]}"
total=$((killed + survived))
score=0
if [[ $total -gt 0 ]]; then
	score=$((100 * killed / total))
fi
echo "mutants: score ${killed}/${total} killed (${score}%), ${survived} survived, ${broken} not planted"
[[ $survived -eq 0 && $broken -eq 0 ]]
