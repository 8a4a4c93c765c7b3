package deploy

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestSystemdUnit checks deploy/systemd against the binary: ExecStart's
// arguments are its flags, every variable of the example environment file
// is one `idemcoord --help` names, the unit reads that file and reloads
// with SIGHUP; and, where systemd-analyze exists, that systemd accepts the
// unit.
func TestSystemdUnit(t *testing.T) {
	bin := coordinator(t)
	flags := binaryFlags(t, bin)
	unit, err := os.ReadFile(filepath.Join("systemd", "idemcoord.service"))
	if err != nil {
		t.Fatal(err)
	}
	settings := map[string][]string{}
	for l := range strings.SplitSeq(string(unit), "\n") {
		if k, v, ok := strings.Cut(l, "="); ok && !strings.HasPrefix(l, "#") {
			settings[k] = append(settings[k], v)
		}
	}
	for key, want := range map[string]string{
		"EnvironmentFile": "/etc/idemcoord/idemcoord.env",
		"ExecReload":      "/bin/kill -HUP $MAINPID",
		"KillSignal":      "SIGTERM",
		"NoNewPrivileges": "yes",
		"ProtectSystem":   "strict",
		"User":            "idemcoord",
	} {
		if got := strings.Join(settings[key], " "); got != want {
			t.Errorf("%s=%s, want %s", key, got, want)
		}
	}
	execStart := strings.Fields(strings.Join(settings["ExecStart"], " "))
	if len(execStart) == 0 || execStart[0] != "/usr/local/bin/idemcoord" {
		t.Fatalf("ExecStart=%v, want /usr/local/bin/idemcoord …", execStart)
	}
	for _, a := range execStart[1:] {
		name, _, hasValue := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		if spec, ok := flags[name]; !strings.HasPrefix(a, "--") || !ok || spec.takesValue != hasValue {
			t.Errorf("ExecStart argument %q is not a flag of idemcoord --help used as --flag=VALUE or --switch", a)
		}
	}

	help, _ := runHelp(bin)
	vars := map[string]bool{}
	for _, m := range regexp.MustCompile(`\(([A-Z][A-Z0-9_]+)\)`).FindAllStringSubmatch(help, -1) {
		vars[m[1]] = true
	}
	env, err := os.ReadFile(filepath.Join("systemd", "idemcoord.env"))
	if err != nil {
		t.Fatal(err)
	}
	for l := range strings.SplitSeq(string(env), "\n") {
		name, _, ok := strings.Cut(strings.TrimPrefix(l, "#"), "=")
		if !ok || strings.Contains(name, " ") {
			continue
		}
		if !vars[name] {
			t.Errorf("idemcoord.env sets %s, which idemcoord --help does not name", name)
		}
	}

	verify(t, bin, string(unit))
}

func runHelp(bin string) (string, error) {
	out, err := exec.Command(bin, "--help").CombinedOutput()
	return string(out), err
}

// verify runs systemd-analyze verify on the unit, with ExecStart pointing
// at bin (systemd checks that the program exists).
func verify(t *testing.T, bin, unit string) {
	t.Helper()
	analyze, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Log("no systemd-analyze: the unit's syntax is not checked by systemd")
		return
	}
	path := filepath.Join(t.TempDir(), "idemcoord.service")
	unit = strings.Replace(unit, "ExecStart=/usr/local/bin/idemcoord", "ExecStart="+bin, 1)
	if err := os.WriteFile(path, []byte(unit), 0o644); err != nil {
		t.Fatal(err)
	}
	// Complaints about the unit name its file; others (about the host's
	// own units) are not the unit's.
	out, err := exec.Command(analyze, "verify", path).CombinedOutput()
	if err != nil || strings.Contains(string(out), path) {
		t.Errorf("systemd-analyze verify: %v\n%s", err, out)
	}
}
