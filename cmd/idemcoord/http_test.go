package main

import (
	"encoding/json"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/idemcoord/idemcoord/internal/coordtest"
	"github.com/idemcoord/idemcoord/internal/pgtest"
)

// readmeCurlCommands returns the curl commands of the README's "Try it with
// curl" block, each joined into one line of shell.
func readmeCurlCommands(t *testing.T) []string {
	t.Helper()
	readme, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(readme), "## Try it with curl")
	if !ok {
		t.Fatal("README.md has no \"Try it with curl\" section")
	}
	_, block, ok := strings.Cut(section, "```sh\n")
	if !ok {
		t.Fatal("no sh block in the curl section")
	}
	block, _, _ = strings.Cut(block, "```")
	var cmds []string
	var cur strings.Builder
	for line := range strings.Lines(block) {
		line = strings.TrimRight(line, "\n")
		if cur.Len() == 0 && !strings.HasPrefix(line, "curl ") {
			continue
		}
		cur.WriteString(line + "\n")
		if !strings.HasSuffix(line, `\`) && strings.Count(cur.String(), "'")%2 == 0 {
			cmds = append(cmds, cur.String())
			cur.Reset()
		}
	}
	return cmds
}

// TestCurlSession runs the README's curl session (Begin, Complete, the
// replay, an error) through curl against the real binary's HTTP listener.
func TestCurlSession(t *testing.T) {
	if _, err := exec.LookPath("curl"); err != nil {
		t.Skip("curl is not installed (.ci/run installs it); skipping the README's curl session")
	}
	cmds := readmeCurlCommands(t)
	if len(cmds) != 4 {
		t.Fatalf("README curl block has %d commands, want 4:\n%s", len(cmds), strings.Join(cmds, "\n"))
	}
	httpAddr := coordtest.FreeAddr(t)
	p := startBinary(t, coordtest.BuildBinary(t), pgtest.NewDatabase(t), coordtest.FreeAddr(t), httpAddr)
	defer p.stop()

	token := ""
	run := func(cmd string) map[string]any {
		t.Helper()
		cmd = strings.ReplaceAll(cmd, "127.0.0.1:9090", httpAddr)
		cmd = strings.ReplaceAll(cmd, "lt1.…", token)
		out, err := exec.Command("bash", "-c", cmd).Output()
		if err != nil {
			t.Fatalf("%s: %v\n%s", cmd, err, out)
		}
		var m map[string]any
		if err := json.Unmarshal(out, &m); err != nil {
			t.Fatalf("%s: answer is not JSON: %v\n%s", cmd, err, out)
		}
		return m
	}
	field := func(m map[string]any, path ...string) any {
		var v any = m
		for _, p := range path {
			mm, _ := v.(map[string]any)
			v = mm[p]
		}
		return v
	}

	m := run(cmds[0])
	token, _ = m["leaseToken"].(string)
	if m["outcome"] != "OUTCOME_ACQUIRED" || !strings.HasPrefix(token, "lt1.") {
		t.Fatalf("1. Begin: %v", m)
	}
	if m = run(cmds[1]); field(m, "record", "state") != "STATE_COMPLETED" {
		t.Fatalf("2. Complete: %v", m)
	}
	m = run(cmds[2])
	if m["outcome"] != "OUTCOME_REPLAY" || field(m, "record", "state") != "STATE_COMPLETED" ||
		field(m, "record", "response", "body") != "aGVsbG8=" || field(m, "record", "response", "statusCode") != 201.0 ||
		field(m, "record", "response", "metadata", "location") != "/builds/7" {
		t.Fatalf("3. replay: %v", m)
	}
	m = run(cmds[3])
	details, _ := m["details"].([]any)
	if m["code"] != "failed_precondition" || len(details) != 1 {
		t.Fatalf("4. error: %v", m)
	}
	d, _ := details[0].(map[string]any)
	if d["type"] != "google.rpc.ErrorInfo" || field(d, "debug", "reason") != "LEASE_LOST" ||
		field(d, "debug", "domain") != "idempotency.v1" {
		t.Fatalf("4. error details: %v", m)
	}
}
