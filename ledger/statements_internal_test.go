package ledger

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestStatementsComplete: every dialect sets every statement, so a
// dialect that misses one fails here rather than at its first call.
func TestStatementsComplete(t *testing.T) {
	for _, d := range []dialect{postgreSQL, citus} {
		st := reflect.ValueOf(statementsFor(d)).Elem()
		for i := range st.NumField() {
			f := st.Field(i)
			if f.Kind() == reflect.Func && f.IsNil() {
				t.Errorf("dialect %d: statement %s is not set", d, st.Type().Field(i).Name)
			}
		}
		for _, n := range []string{"Listen", "Dropped", "Ping", "QueueUsage"} {
			if st.FieldByName("notifier").FieldByName(n).String() == "" {
				t.Errorf("dialect %d: the notifier's %s is not set", d, n)
			}
		}
	}
}

// sqlText is what marks a string literal as SQL.
var sqlText = regexp.MustCompile(`(?i)\b(SELECT|INSERT INTO|UPDATE|DELETE FROM|LISTEN|SET LOCAL)\b\s|idempotency_|idemcoord_notify`)

// TestStatementsInOnePlace: no code of the ledger (its tests and
// migrations aside) holds SQL outside the statement layer, so that a
// dialect changes a statement in one place.
func TestStatementsInOnePlace(t *testing.T) {
	allowed := map[string]bool{"statements.go": true}
	err := filepath.WalkDir(".", func(path string, d os.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") || allowed[path] {
			return err
		}
		f, err := parser.ParseFile(token.NewFileSet(), path, nil, 0)
		if err != nil {
			return err
		}
		ast.Inspect(f, func(n ast.Node) bool {
			lit, ok := n.(*ast.BasicLit)
			if !ok || lit.Kind != token.STRING {
				return true
			}
			if v, err := strconv.Unquote(lit.Value); err == nil && sqlText.MatchString(v) {
				t.Errorf("%s holds SQL outside statements.go: %.60q", path, v)
			}
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestHotStatementsLeaveCheckpointsAlone: the statements of the hot paths
// (the Begin of a new key, alone and batched, and the holder's Complete,
// alone and batched) never write the checkpoint columns, so a checkpoint
// costs them no write, but they return them, so that the record their
// answers carry has its checkpoint (the holder's Complete answered
// without it before); the statements that rewrite or read a whole record
// carry them too, so no rewrite drops a checkpoint.
func TestHotStatementsLeaveCheckpointsAlone(t *testing.T) {
	// A write of a checkpoint column: an assignment, or a column list of
	// an INSERT naming one.
	checkpointWrite := regexp.MustCompile(`checkpoint_\w+\s*=|INSERT INTO \w+ \([^)]*checkpoint_`)
	id := Identity{Tenant: "t", Scope: "s", Key: "k"}
	n := newRecord{id: id}
	for _, d := range []dialect{postgreSQL, citus} {
		st := statementsFor(d)
		for name, q := range map[string]query{
			"begin":         st.begin(n, "", nil, time.Second),
			"beginBatch":    st.beginBatch([]newRecord{n}, "", nil, time.Second),
			"completeHeld":  st.completeHeld(id, "tok", storedResponse{}, nil),
			"completeBatch": st.completeBatch([]heldCompletion{{id: id}}, nil),
		} {
			if written := checkpointWrite.FindString(q.sql); written != "" {
				t.Errorf("%v %s writes the checkpoint columns (%q):\n%s", d, name, written, q.sql)
			}
			if !strings.Contains(q.sql, "checkpoint_phase, ") && !strings.Contains(q.sql, "checkpoint_phase,\n") {
				t.Errorf("%v %s does not return the checkpoint columns:\n%s", d, name, q.sql)
			}
		}
		for name, q := range map[string]query{
			"read":        st.read(id, nil),
			"lock":        st.lock(id, nil),
			"lockNow":     st.lockNow(id, nil),
			"insert":      st.insert(id, nil),
			"update":      st.update(id, nil),
			"legacyBatch": st.legacyBatch(nil, 1),
			"reapArchive": st.reapArchive(&ReapParams{}, nil, 1),
			"reapExpired": st.reapExpired(nil, 1),
		} {
			text := q.sql
			if len(q.args) > 0 {
				if inner, ok := q.args[0].(string); ok {
					text += inner // citusPerShard's statement, run on each shard
				}
			}
			for _, c := range checkpointColumnNames {
				if !strings.Contains(text, c) {
					t.Errorf("%v %s does not carry %s:\n%s", d, name, c, q.sql)
				}
			}
		}
	}
}
