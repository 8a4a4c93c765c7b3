package doccheck

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// flagDefaults returns the real default of every flag of a binary of this
// module, as its -h prints them (with no IDEMCOORD_* variable set, since
// the variables change what -h shows): name → default ("" for none,
// "false" for a boolean without one).
func flagDefaults(t *testing.T, pkg string) map[string]string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), filepath.Base(pkg))
	build := exec.Command("go", "build", "-o", bin, pkg)
	build.Dir = root
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build %s: %v\n%s", pkg, err, out)
	}
	cmd := exec.Command(bin, "-h")
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "IDEMCOORD_") && !strings.HasPrefix(kv, "DATABASE_URL=") && !strings.HasPrefix(kv, "OTEL_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	out, _ := cmd.CombinedOutput() // -h exits 0 or 2 depending on the flag package's mode
	defaults := map[string]string{}
	flagLine := regexp.MustCompile(`^  -([a-z0-9-]+)(?: (\w+))?$`)
	defaultOf := regexp.MustCompile(`\(default "?([^"]*?)"?\)$`)
	ctlLine := regexp.MustCompile(`^\s+--([a-z0-9-]+)\s{2,}(.*)$`)
	ctlDefault := regexp.MustCompile(`\(default (?:\$[A-Z_]+(?:, else )?)?([^)$]*)\)`)
	var name, typ string
	for line := range strings.SplitSeq(string(out), "\n") {
		// idemctl's own usage: "  --name   what it is (default $VAR, else V)"
		if m := ctlLine.FindStringSubmatch(line); m != nil {
			name = ""
			defaults[m[1]] = ""
			if d := ctlDefault.FindStringSubmatch(m[2]); d != nil {
				defaults[m[1]] = d[1]
			}
			continue
		}
		if m := flagLine.FindStringSubmatch(line); m != nil {
			name, typ = m[1], m[2]
			defaults[name] = ""
			if typ == "" {
				defaults[name] = "false"
			}
			continue
		}
		if name == "" {
			continue
		}
		if m := defaultOf.FindStringSubmatch(strings.TrimSpace(line)); m != nil {
			defaults[name] = m[1]
		}
	}
	if len(defaults) < 5 {
		t.Fatalf("%s -h: found only %d flags: the parser of its usage is broken\n%s", pkg, len(defaults), out)
	}
	return defaults
}

// defaultMention is one place a page states a flag's default.
type defaultMention struct {
	pos, flag, value string
}

var (
	// a table row `| `--flag`, `--other` (...) | value | ...`
	flagRow  = regexp.MustCompile("^\\|\\s*(`--[a-z0-9-]+`[^|]*)\\|([^|]*)\\|")
	flagSpan = regexp.MustCompile("`--([a-z0-9-]+)`")
	// "`--flag`, default `V`", "`--flag` (default V)", "`--flag` (`VAR`, default `V`)"
	flagThenDefault = regexp.MustCompile("`--([a-z0-9-]+)`(?:\\s*\\([^)]*?|[,:]?)\\s*\\(?default:?\\s+(`[^`]+`|[0-9][0-9a-zA-Z.:]*(?: (?:ns|us|ms|s|m|h)\\b)?)")
	// "`--flag`, now V by default", "`--flag` is V by default"
	flagThenByDefault = regexp.MustCompile("`--([a-z0-9-]+)`[,:]?\\s+(?:is\\s+|now\\s+)?(`[^`]+`|[0-9][0-9a-zA-Z.:]*)\\s+(?:[a-z]+\\s+){0,3}by default")
	// "V worker(s) ... by default, `--flag`"
	byDefaultThenFlag = regexp.MustCompile("(`[^`]+`|[0-9][0-9a-zA-Z.:]*)\\s+(?:[a-z]+\\s+){0,3}by default,\\s+`--([a-z0-9-]+)`")
)

// defaultMentions finds every statement of a flag's default on the pages:
// the rows of flag tables (a `default` column) and sentences that put a
// flag next to "default".
func defaultMentions(t *testing.T, pages []*page) []defaultMention {
	t.Helper()
	var ms []defaultMention
	for _, p := range pages {
		// Prose is checked per paragraph, joined, since a sentence may wrap
		// between the flag and its default.
		var para []string
		var paraLine int
		sentences := func(text string, n int) {
			for _, m := range flagThenDefault.FindAllStringSubmatch(text, -1) {
				ms = append(ms, defaultMention{fmt2(p.path, n), m[1], m[2]})
			}
			for _, m := range flagThenByDefault.FindAllStringSubmatch(text, -1) {
				ms = append(ms, defaultMention{fmt2(p.path, n), m[1], m[2]})
			}
			for _, m := range byDefaultThenFlag.FindAllStringSubmatch(text, -1) {
				ms = append(ms, defaultMention{fmt2(p.path, n), m[2], m[1]})
			}
		}
		flush := func() {
			sentences(strings.Join(para, " "), paraLine)
			para = nil
		}
		inDefaultTable := false
		for n := 1; n <= len(p.lines); n++ {
			line, ok := p.prose[n]
			if !ok || strings.TrimSpace(line) == "" {
				flush()
				inDefaultTable = false
				continue
			}
			if strings.HasPrefix(line, "|") {
				flush()
				cells := strings.Split(line, "|")
				if len(cells) > 2 && strings.TrimSpace(cells[2]) == "default" {
					inDefaultTable = true
				}
				if m := flagRow.FindStringSubmatch(line); m != nil && inDefaultTable {
					for _, f := range flagSpan.FindAllStringSubmatch(m[1], -1) {
						ms = append(ms, defaultMention{fmt2(p.path, n), f[1], m[2]})
					}
					continue
				}
				sentences(line, n) // a cell's prose
				continue
			}
			if len(para) == 0 {
				paraLine = n
			}
			para = append(para, line)
		}
		flush()
	}
	return ms
}

func fmt2(path string, line int) string { return fmt.Sprintf("%s:%d", path, line) }

// normalizeDefault reduces a stated default to the flag package's spelling:
// the first code span of a table cell or the bare value, "" for an empty
// cell.
func normalizeDefault(s string) string {
	s = strings.TrimSpace(s)
	if i := strings.Index(s, "`"); i >= 0 {
		if j := strings.Index(s[i+1:], "`"); j >= 0 {
			return s[i+1 : i+1+j]
		}
	}
	f := strings.Fields(s)
	if len(f) == 0 {
		return ""
	}
	v := strings.TrimRight(f[0], ":,;")
	// "30 s" is a duration written for people: the flag spells it 30s.
	if len(f) > 1 && durationUnit[strings.TrimRight(f[1], ":,;)")] {
		if _, err := strconv.ParseFloat(v, 64); err == nil {
			return v + strings.TrimRight(f[1], ":,;)")
		}
	}
	return v
}

// durationUnit holds the units of Go's duration syntax.
var durationUnit = map[string]bool{"ns": true, "us": true, "ms": true, "s": true, "m": true, "h": true}

// TestStatedFlagDefaultsAreTheFlagsDefaults: wherever a page states the
// default of a flag of idemcoord or idemctl, it is the default the binary
// has; so no two pages can state one default differently.
func TestStatedFlagDefaultsAreTheFlagsDefaults(t *testing.T) {
	coord := flagDefaults(t, "./cmd/idemcoord")
	ctl := flagDefaults(t, "./cmd/idemctl")
	mentions := defaultMentions(t, linkPages(t))
	checked := map[string]bool{}
	for _, m := range mentions {
		want, ok := coord[m.flag]
		if !ok {
			want, ok = ctl[m.flag]
		}
		if !ok {
			t.Errorf("%s: states a default for --%s, which neither idemcoord nor idemctl has", m.pos, m.flag)
			continue
		}
		if got := normalizeDefault(m.value); got != want {
			t.Errorf("%s: says --%s defaults to %q; its default is %q", m.pos, m.flag, got, want)
			continue
		}
		checked[m.flag] = true
	}
	// The flag table of the operating page must state every flag of the
	// coordinator, so the check covers them all.
	for name := range coord {
		if !checked[name] {
			t.Errorf("no page states the default of idemcoord --%s (docs/operating.md's flag table should)", name)
		}
	}
	t.Logf("%d statements of a flag's default match the binaries", len(mentions))
}
