package doccheck

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// outsideDesign matches a citation of a design document that is not in the
// repository: the repository's own design is docs/design.md, and code and
// docs cite that.
var outsideDesign = regexp.MustCompile(`\bDESIGN(\.md)?\b`)

// upstreamRefs are issues of other projects named with their repository
// (golang/go#27505): a reader can find those.
var upstreamRefs = regexp.MustCompile(`\b[\w.-]+/[\w.-]+#\d+`)

// TestRepositoryStandsAlone: no tracked text file cites a document outside
// the repository or an issue of a tracker the reader cannot reach. Recorded
// benchmark results (bench/results) are data and are left out.
func TestRepositoryStandsAlone(t *testing.T) {
	out, err := exec.Command("git", "-C", root, "ls-files", "-z").Output()
	if err != nil {
		t.Skipf("not a git checkout: %v", err)
	}
	checked := 0
	for name := range strings.SplitSeq(strings.TrimRight(string(out), "\x00"), "\x00") {
		if name == "" || strings.HasPrefix(name, "bench/results/") || strings.HasPrefix(name, "gen/") {
			continue
		}
		b, err := os.ReadFile(filepath.Join(root, name))
		if err != nil || bytes.IndexByte(b, 0) >= 0 {
			continue // deleted in the working tree, or binary
		}
		checked++
		for i, line := range strings.Split(string(b), "\n") {
			if m := outsideDesign.FindString(line); m != "" {
				t.Errorf("%s:%d: %q: cite docs/design.md, the repository's own design", name, i+1, m)
			}
			if m := issueRefs.FindString(upstreamRefs.ReplaceAllString(line, "")); m != "" && !strings.HasSuffix(name, ".json") && !looksLikeColour(line, m) {
				t.Errorf("%s:%d: %q: no issue numbers in the repository", name, i+1, m)
			}
		}
	}
	if checked < 100 {
		t.Fatalf("checked only %d files: the walk is broken", checked)
	}
}

// looksLikeColour tells a CSS or SVG colour (a hash sign and three to
// eight hex digits, on a line that names a colour property) from an issue
// reference.
func looksLikeColour(line, m string) bool {
	return strings.HasPrefix(m, "#") && regexp.MustCompile(`#[0-9a-fA-F]{3,8}\b`).MatchString(line) &&
		(strings.Contains(line, "color") || strings.Contains(line, "fill") || strings.Contains(line, "stroke") ||
			strings.Contains(line, "background") || strings.Contains(line, "border"))
}
