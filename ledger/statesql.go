package ledger

import (
	"strconv"
	"strings"

	"github.com/idemcoord/idemcoord/statemachine"
)

// stateSQL writes the states and endings that a statement names into its
// text: {IN_PROGRESS}, {COMPLETED}, … (statemachine.State's names) become
// the numbers stored in idempotency_records.state, and
// {ENDED_BY_COMPLETED}, … the numbers stored in ended_by. The numbers are
// written inline, not passed as parameters, so the planner matches them
// with the partial indexes (WHERE state = 1, …) under generic plans too.
// Statements call it once, when the package is initialised (the reaper's
// archive statement, built per pass, at each pass). It panics on a name it
// does not know: the package then fails to start, so any of its tests
// catches it.
func stateSQL(text string) string {
	var pairs []string
	for s := statemachine.StateInProgress; s <= statemachine.StateUnknown; s++ {
		pairs = append(pairs, "{"+s.String()+"}", strconv.Itoa(int(s)))
	}
	for _, e := range []struct {
		name string
		e    statemachine.Ending
	}{
		{"NONE", statemachine.EndingNone},
		{"RETRYABLE", statemachine.EndingRetryable},
		{"REPLAYABLE", statemachine.EndingReplayable},
		{"UNKNOWN", statemachine.EndingUnknown},
		{"ABANDONED", statemachine.EndingAbandoned},
		{"COMPLETED", statemachine.EndingCompleted},
		{"RESOLVED", statemachine.EndingResolved},
		{"RESOLVED_RETRYABLE", statemachine.EndingResolvedRetryable},
	} {
		pairs = append(pairs, "{ENDED_BY_"+e.name+"}", strconv.Itoa(int(e.e)))
	}
	out := strings.NewReplacer(pairs...).Replace(text)
	for rest := out; ; {
		i := strings.IndexByte(rest, '{')
		if i < 0 {
			return out
		}
		rest = rest[i+1:]
		if rest != "" && rest[0] >= 'A' && rest[0] <= 'Z' {
			panic("ledger: unknown state or ending in SQL: {" + rest[:min(len(rest), 30)])
		}
	}
}
