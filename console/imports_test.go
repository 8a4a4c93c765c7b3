package console_test

import (
	"go/parser"
	"go/token"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// TestImports holds the layout rule of doc.go: the console is an Admin API
// client and never imports ledger or server.
func TestImports(t *testing.T) {
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		parsed, err := parser.ParseFile(token.NewFileSet(), f, nil, parser.ImportsOnly)
		if err != nil {
			t.Fatal(err)
		}
		for _, imp := range parsed.Imports {
			path, _ := strconv.Unquote(imp.Path.Value)
			for _, banned := range []string{"github.com/idemcoord/idemcoord/ledger", "github.com/idemcoord/idemcoord/server",
				"github.com/idemcoord/idemcoord/statemachine"} {
				if path == banned || strings.HasPrefix(path, banned+"/") {
					t.Errorf("%s imports %s", f, path)
				}
			}
		}
	}
}
