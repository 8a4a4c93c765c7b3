package layout_test

import (
	"go/parser"
	"go/token"
	"io/fs"
	"maps"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// module is the module path; imports under it are the project's own.
const module = "github.com/idemcoord/idemcoord"

// rule is one row of the layout table: what the non-test files of the
// packages at a path may import.
type rule struct {
	// own lists the project's packages (paths relative to the module, each
	// with everything under it) that may be imported.
	own []string
	// third lists the third-party modules (path prefixes) that may be
	// imported; nil means any but those in deny.
	third []string
	// deny lists third-party modules that may not be imported.
	deny []string
	// stdOnly: the standard library and nothing else.
	stdOnly bool
}

// pgx stays below ledger: no pgx type leaks above it (the design's storage
// edge).
var noPgx = []string{"github.com/jackc/pgx"}

// layout is the design's layout table, "may import" column, as rules. A
// path's rule holds for the package there and every package under it
// without a row of its own. Extras beyond the design's column are marked
// "extra" with the reason.
var layout = map[string]rule{
	"gen":          {own: []string{"gen"}},
	"statemachine": {stdOnly: true},
	// extra: golang-migrate is the "maintained migration library" that
	// applies the embedded migrations (the design's Storage section).
	// extra: ledger/internal, the ledger's own parts (below).
	"ledger": {own: []string{"statemachine", "ledger/internal"},
		third: []string{"github.com/jackc/pgx/v5", "github.com/golang-migrate/migrate/v4"}},
	// The ledger's parts, each its own concern; none imports ledger.
	"ledger/internal/coalescer":   {stdOnly: true},
	"ledger/internal/notifier":    {third: []string{"github.com/jackc/pgx/v5"}},
	"ledger/internal/replaycache": {own: []string{"statemachine"}, third: []string{}},
	// extra: internal/errorinfo, the one place reasons get their wire names.
	"server": {own: []string{"ledger", "statemachine", "gen", "internal/errorinfo"}, deny: noPgx},
	// extra: internal/errorinfo, as for server.
	"clients":          {own: []string{"gen", "internal/errorinfo"}, deny: noPgx},
	"clients/polyglot": {stdOnly: true}, // tests only
	"console":          {own: []string{"gen", "clients"}, deny: noPgx},
	// extra: console, which the binary serves under /console/ with --console.
	"cmd/idemcoord": {own: []string{"server", "ledger", "console"}},
	"cmd/idemctl":   {own: []string{"clients", "gen"}, deny: noPgx},
	// Examples import what a user's service can: public packages only.
	"examples": {own: []string{"examples", "clients", "ledger", "statemachine", "gen"}},
	// The benchmark driver (go run ./bench) starts its own PostgreSQL.
	// extra: clients, the Go client library the callers can drive the cells with (-client go).
	// extra: bench/internal/procstat, the bench's and bench/grpcfloor's one reader of /proc.
	// extra: bench/internal/floor, the grpc-go server of canned answers under the
	// unary path (the bench's floor rows and bench/grpcfloor).
	"bench":                   {own: []string{"gen", "ledger", "internal/pgtest", "clients", "bench/internal/procstat", "bench/internal/floor"}},
	"bench/internal/procstat": {stdOnly: true},
	"bench/internal/floor": {own: []string{"gen"},
		third: []string{"google.golang.org/grpc", "google.golang.org/protobuf"}},
	"chaos": {own: []string{}}, // tests only
	// The deployment files' checks (chart, alerts, dashboard, image, unit).
	"deploy": {stdOnly: true}, // tests only
	// Test helpers.
	"internal/pgtest":                    {},
	"internal/coordtest":                 {own: []string{"internal/pgtest", "ledger", "server"}},
	"internal/cmd/throwaway-coordinator": {own: []string{"internal/pgtest"}},
	"internal/crashfs":                   {},
	"internal/testkit":                   {stdOnly: true},
	"internal/doccheck":                  {stdOnly: true}, // tests only
	"internal/errorinfo":                 {own: []string{"gen"}, third: []string{"google.golang.org/genproto/googleapis/rpc/errdetails"}},
	"internal/layout":                    {stdOnly: true}, // tests only
}

// TestImports parses the imports of every non-test Go file of the module
// and checks them against layout. Test files are exempt: a package's tests
// may start a whole coordinator (internal/coordtest). A package without a
// row fails the test, so a new package gets a row when it is added.
func TestImports(t *testing.T) {
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	imports := moduleImports(t, root)
	if len(imports) < 10 {
		t.Fatalf("found only %d packages under %s", len(imports), root)
	}
	t.Logf("%d packages checked", len(imports))
	for _, pkg := range slices.Sorted(maps.Keys(imports)) {
		r, ok := ruleFor(pkg)
		if !ok {
			t.Errorf("%s: no row in the layout table (internal/layout/layout_test.go); add one as the design's table says", pkg)
			continue
		}
		for imp, files := range imports[pkg] {
			if why := r.refuses(imp); why != "" {
				t.Errorf("%s imports %s (%s), which %s", pkg, imp, strings.Join(files, ", "), why)
			}
		}
	}
}

// refuses says why r does not allow imp, or "" when it does.
func (r rule) refuses(imp string) string {
	first, _, _ := strings.Cut(imp, "/")
	switch {
	case !strings.Contains(first, "."):
		return "" // the standard library
	case r.stdOnly:
		return "may import only the standard library"
	case imp == module || strings.HasPrefix(imp, module+"/"):
		rel := strings.TrimPrefix(strings.TrimPrefix(imp, module), "/")
		if under(rel, r.own) {
			return ""
		}
		return "may import only " + list(r.own) + " of this module"
	case r.third != nil && !under(imp, r.third):
		return "may import only " + list(r.third) + " besides the standard library"
	case under(imp, r.deny):
		return "may not import " + list(r.deny)
	}
	return ""
}

// under reports whether p is one of prefixes or under one of them.
func under(p string, prefixes []string) bool {
	for _, pre := range prefixes {
		if p == pre || strings.HasPrefix(p, pre+"/") {
			return true
		}
	}
	return false
}

func list(s []string) string {
	if len(s) == 0 {
		return "nothing"
	}
	return strings.Join(s, ", ")
}

// ruleFor finds the row of pkg (a path relative to the module): its own, or
// that of the nearest directory above it that has one.
func ruleFor(pkg string) (rule, bool) {
	for p := pkg; p != "." && p != "/" && p != ""; p = path.Dir(p) {
		if r, ok := layout[p]; ok {
			return r, true
		}
	}
	return rule{}, false
}

// moduleImports maps every package directory of the module (relative to
// root) to its non-test files' imports, each with the files that import it.
// Other modules nested in the tree (a directory with its own go.mod),
// testdata, node_modules and hidden or underscore directories are skipped,
// as the go command skips them.
func moduleImports(t *testing.T, root string) map[string]map[string][]string {
	t.Helper()
	out := map[string]map[string][]string{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			name := d.Name()
			if p != root && (strings.HasPrefix(name, ".") || strings.HasPrefix(name, "_") || name == "testdata" ||
				name == "node_modules") {
				return filepath.SkipDir
			}
			if p != root {
				if _, err := os.Stat(filepath.Join(p, "go.mod")); err == nil {
					return filepath.SkipDir
				}
			}
			return nil
		}
		if !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(token.NewFileSet(), p, nil, parser.ImportsOnly)
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, filepath.Dir(p))
		if err != nil {
			return err
		}
		pkg := filepath.ToSlash(rel)
		if out[pkg] == nil {
			out[pkg] = map[string][]string{}
		}
		for _, imp := range f.Imports {
			ip, err := strconv.Unquote(imp.Path.Value)
			if err != nil {
				return err
			}
			out[pkg][ip] = append(out[pkg][ip], filepath.Base(p))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}
