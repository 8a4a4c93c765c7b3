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
