package ledger

import (
	"strings"
	"testing"
)

// TestStateSQL: stateSQL writes each state and ending as the number it is
// stored as, and refuses a name it does not know.
func TestStateSQL(t *testing.T) {
	got := stateSQL(`state IN ({IN_PROGRESS}, {COMPLETED}, {FAILED_RETRYABLE}, {FAILED_REPLAYABLE}, {EXPIRED}, {UNKNOWN})` +
		` AND ended_by IN ({ENDED_BY_NONE}, {ENDED_BY_RETRYABLE}, {ENDED_BY_REPLAYABLE}, {ENDED_BY_UNKNOWN},` +
		` {ENDED_BY_ABANDONED}, {ENDED_BY_COMPLETED}, {ENDED_BY_RESOLVED}, {ENDED_BY_RESOLVED_RETRYABLE}) AND a = '{}'`)
	if want := `state IN (1, 2, 3, 4, 5, 6) AND ended_by IN (0, 1, 2, 3, 4, 5, 6, 7) AND a = '{}'`; got != want {
		t.Errorf("stateSQL = %q, want %q", got, want)
	}
	for _, bad := range []string{"state = {RUNNING}", "state = {NONE}", "x = '{}' AND state = {in_progress} AND {EXPIRD}"} {
		func() {
			defer func() {
				if p := recover(); p == nil || !strings.Contains(p.(string), "unknown state or ending") {
					t.Errorf("stateSQL(%q) did not panic naming the unknown state (%v)", bad, p)
				}
			}()
			stateSQL(bad)
		}()
	}
}
