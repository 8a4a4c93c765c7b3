package doccheck

import (
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// makeTargets returns the targets the Makefile defines by name (not the
// tool stamp files under $(BIN)).
func makeTargets(t *testing.T) []string {
	t.Helper()
	rule := regexp.MustCompile(`^([A-Za-z0-9_-]+)\s*:([^=]|$)`)
	var ts []string
	for line := range strings.SplitSeq(mustRead(t, "Makefile"), "\n") {
		if m := rule.FindStringSubmatch(line); m != nil && !slices.Contains(ts, m[1]) {
			ts = append(ts, m[1])
		}
	}
	if len(ts) < 10 {
		t.Fatalf("found only %d targets in the Makefile: the rule parser is broken", len(ts))
	}
	return ts
}

// prerequisites returns each named target's prerequisites.
func prerequisites(t *testing.T) map[string][]string {
	t.Helper()
	rule := regexp.MustCompile(`^([A-Za-z0-9_-]+)\s*:([^=].*|)$`)
	out := map[string][]string{}
	for line := range strings.SplitSeq(mustRead(t, "Makefile"), "\n") {
		if m := rule.FindStringSubmatch(line); m != nil {
			out[m[1]] = append(out[m[1]], strings.Fields(m[2])...)
		}
	}
	return out
}

// makeHelp runs `make help` and returns each target's help text.
func makeHelp(t *testing.T) map[string]string {
	t.Helper()
	cmd := exec.Command("make", "-s", "--no-print-directory", "help")
	cmd.Dir = root
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("make help: %v", err)
	}
	help := map[string]string{}
	var name string
	for line := range strings.SplitSeq(string(out), "\n") {
		if strings.TrimSpace(line) == "" {
			continue
		}
		if f := strings.Fields(line); !strings.HasPrefix(line, "   ") && len(f) > 0 {
			name = f[0]
			help[name] = strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(line), name))
			continue
		}
		if name != "" {
			help[name] += " " + strings.TrimSpace(line)
		}
	}
	return help
}

// TestMakeHelpListsEveryTargetTruly: `make help` names every target of the
// Makefile and no other, and what it claims is true where it can be
// checked: the binaries `build` builds, the tools `tools` installs, the
// addresses a target serves on.
func TestMakeHelpListsEveryTargetTruly(t *testing.T) {
	targets := makeTargets(t)
	help := makeHelp(t)
	for _, tg := range targets {
		if _, ok := help[tg]; !ok {
			t.Errorf("make help does not list the target %q: give it a `## %s: …` line", tg, tg)
		}
	}
	for name := range help {
		if !slices.Contains(targets, name) {
			t.Errorf("make help lists %q, which is no target of the Makefile", name)
		}
	}

	// What a target builds: every `go build -o OUT` of its recipe is named
	// in its help, and one that does not build every command does not say so.
	cmds, err := filepath.Glob(filepath.Join(root, "cmd", "*"))
	if err != nil {
		t.Fatal(err)
	}
	goBuild := regexp.MustCompile(`go build (?:[^\n]*?)-o (\S+) (\./\S+)`)
	dryRun := func(tg string) string {
		dry := exec.Command("make", "-n", "--no-print-directory", tg)
		dry.Dir = root
		out, _ := dry.Output() // a target that cannot dry-run here (a missing tool) shows what it can
		return string(out)
	}
	prereqs := prerequisites(t)
	for _, tg := range targets {
		// What the target itself runs: its dry run without its named
		// prerequisites' (run depends on build; what build builds is
		// build's claim).
		own := dryRun(tg)
		for _, pre := range prereqs[tg] {
			if slices.Contains(targets, pre) {
				for l := range strings.SplitSeq(dryRun(pre), "\n") {
					if l != "" {
						own = strings.Replace(own, l+"\n", "", 1)
					}
				}
			}
		}
		builds := goBuild.FindAllStringSubmatch(own, -1)
		if len(builds) == 0 {
			continue
		}
		text := help[tg]
		for _, b := range builds {
			if !strings.Contains(text, filepath.Base(b[1])) {
				t.Errorf("make help: %s builds %s (%s) but its help does not say so: %q", tg, filepath.Base(b[1]), b[2], text)
			}
		}
		if len(builds) < len(cmds) && regexp.MustCompile(`(?i)\b(every|all)\b[^.;]*\b(binar|command|package)`).MatchString(text) {
			t.Errorf("make help: %s builds %d of the %d commands under cmd/, but says %q", tg, len(builds), len(cmds), text)
		}
	}

	// What `tools` installs: every stamp file it depends on names a tool
	// its help lists.
	stamp := regexp.MustCompile(`\$\(BIN\)/\.([a-z-]+?)-\$\(`)
	mk := mustRead(t, "Makefile")
	i := strings.Index(mk, "\ntools:")
	if i < 0 {
		t.Fatal("no tools target in the Makefile")
	}
	deps := mk[i:]
	deps, _, _ = strings.Cut(deps, "\n\n")
	tools := stamp.FindAllStringSubmatch(deps, -1)
	if len(tools) == 0 {
		t.Fatal("found no tool stamp files in the tools target: the parser is broken")
	}
	for _, m := range tools {
		if !strings.Contains(help["tools"], m[1]) {
			t.Errorf("make help: tools installs %s but its help does not list it: %q", m[1], help["tools"])
		}
	}

	// Addresses: a help line that names a loopback address names one the
	// coordinator serves on by default.
	defaults := flagDefaults(t, "./cmd/idemcoord")
	addr := regexp.MustCompile(`127\.0\.0\.1:\d+`)
	for name, text := range help {
		for _, a := range addr.FindAllString(text, -1) {
			if a != defaults["listen"] && a != defaults["http-listen"] {
				t.Errorf("make help: %s names %s, which is neither --listen's default (%s) nor --http-listen's (%s)", name, a, defaults["listen"], defaults["http-listen"])
			}
		}
	}
}

// TestMakeTargetsNamedInDocsExist: every `make TARGET` a page names is a
// target of the Makefile.
func TestMakeTargetsNamedInDocsExist(t *testing.T) {
	targets := makeTargets(t)
	named := regexp.MustCompile("`make ([a-z][a-z0-9_-]*)")
	n := 0
	for _, p := range linkPages(t) {
		for i, line := range p.lines {
			for _, m := range named.FindAllStringSubmatch(line, -1) {
				n++
				if !slices.Contains(targets, m[1]) {
					t.Errorf("%s:%d: `make %s`: the Makefile has no such target", p.path, i+1, m[1])
				}
			}
		}
	}
	if n == 0 {
		t.Fatal("no `make TARGET` found in the docs: the parser is broken")
	}
}
