package clients_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"unicode"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/idemcoord/idemcoord/clients"
)

func TestDedupKey(t *testing.T) {
	t.Parallel()
	sum := sha256.Sum256([]byte("flower shop"))
	want := "create-project:u1:n:" + hex.EncodeToString(sum[:])[:16]
	for _, name := range []string{"flower shop", " Flower  Shop ", "FLOWER\tSHOP\n", "flower \u00a0 shop"} {
		if got := clients.DedupKey("create-project", "u1", "", name); got != want {
			t.Errorf("DedupKey(%q) = %q, want %q", name, got, want)
		}
	}
	for _, other := range []struct{ intent, user, name string }{
		{"create-project", "u2", "flower shop"},
		{"delete-project", "u1", "flower shop"},
		{"create-project", "u1", "flowershop"},
	} {
		if got := clients.DedupKey(other.intent, other.user, "", other.name); got == want {
			t.Errorf("DedupKey(%+v) collides with %q", other, want)
		}
	}
	if got := clients.DedupKey("rename", "u1", "prj_7", "ignored"); got != "rename:u1:p:prj_7" {
		t.Errorf("with a project id: %q", got)
	}
}

func TestNormalizeName(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		" Flower  Shop ": "flower shop", "": "", "  ": "", "ÄPFEL\t\tund  Birnen": "äpfel und birnen",
		// Invalid UTF-8 (which Node and Python strings cannot hold): one
		// U+FFFD per run of bad bytes, as strings.ToValidUTF8 does.
		"\xffShop": "\ufffdshop", "A\xff\xfe\xfdB": "a\ufffdb", "\xed\xa0\x80 X": "\ufffd x",
	} {
		if got := clients.NormalizeName(in); got != want {
			t.Errorf("NormalizeName(%q) = %q, want %q", in, got, want)
		}
	}
	// Every White_Space character separates words and is trimmed; nothing
	// else between two letters does.
	for r := rune(0); r <= unicode.MaxRune; r++ {
		ws := unicode.Is(unicode.White_Space, r)
		if !ws && !unicode.In(r, unicode.Cc, unicode.Cf, unicode.Zs, unicode.Zl, unicode.Zp) {
			continue
		}
		got := clients.NormalizeName(string(r) + "a" + string(r) + "b" + string(r))
		switch {
		case ws && got != "a b":
			t.Errorf("White_Space %U: %q, want \"a b\"", r, got)
		case !ws && r == '\uFEFF' && got != "ab":
			t.Errorf("U+FEFF: %q, want \"ab\"", got)
		case !ws && r != '\uFEFF' && strings.Contains(got, " "):
			t.Errorf("%U is not White_Space, but %q has a space", r, got)
		}
	}
}

// dedupVectors are the cases of clients/testdata/dedupkey.json, which the
// Node and Python libraries test against too.
type dedupVector struct {
	Comment     string `json:"comment"`
	Intent      string `json:"intent"`
	UserID      string `json:"user_id"`
	ProjectID   string `json:"project_id"`
	ProjectName string `json:"project_name"`
	Normalized  string `json:"normalized"`
	Key         string `json:"key"`
}

func TestDedupKeyVectors(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile(filepath.Join("testdata", "dedupkey.json"))
	if err != nil {
		t.Fatal(err)
	}
	var file struct {
		Cases []dedupVector `json:"cases"`
	}
	if err := json.Unmarshal(raw, &file); err != nil {
		t.Fatal(err)
	}
	if len(file.Cases) < 40 {
		t.Fatalf("%d vectors, want at least 40", len(file.Cases))
	}
	for _, c := range file.Cases {
		if got := clients.NormalizeName(c.ProjectName); got != c.Normalized {
			t.Errorf("%s: NormalizeName(%+q) = %+q, want %+q", c.Comment, c.ProjectName, got, c.Normalized)
		}
		if got := clients.DedupKey(c.Intent, c.UserID, c.ProjectID, c.ProjectName); got != c.Key {
			t.Errorf("%s: DedupKey(%q, %q, %q, %+q) = %q, want %q", c.Comment, c.Intent, c.UserID, c.ProjectID, c.ProjectName, got, c.Key)
		}
	}
}

func TestFoldPrincipal(t *testing.T) {
	t.Parallel()
	a, b := clients.FoldPrincipal("alice", "k"), clients.FoldPrincipal("bob", "k")
	if a == b || !strings.HasSuffix(a, ":k") || len(a) != 43+2 {
		t.Fatalf("FoldPrincipal: %q, %q", a, b)
	}
	// A separator in the principal cannot forge another user's key.
	if clients.FoldPrincipal("a:b", "c") == clients.FoldPrincipal("a", "b:c") {
		t.Fatal("ambiguous folding")
	}
}

func TestFingerprint(t *testing.T) {
	t.Parallel()
	req := chargeReq(100)
	got, err := clients.Fingerprint(chargeMethod, req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := proto.MarshalOptions{Deterministic: true}.Marshal(req)
	want := sha256.Sum256(append([]byte(chargeMethod+"\n"), body...))
	if !bytes.Equal(got, want[:]) {
		t.Fatalf("Fingerprint = %x, want %x", got, want)
	}
	other, _ := clients.Fingerprint(createMethod, req)
	if bytes.Equal(got, other) {
		t.Fatal("the method is not part of the fingerprint")
	}
}

func TestKeyFromMetadata(t *testing.T) {
	t.Parallel()
	ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs(clients.MetadataKey, "a", clients.MetadataKey, "a"))
	if k, err := clients.KeyFromMetadata(ctx); k != "a" || err != nil {
		t.Fatalf("repeated value: %q, %v", k, err)
	}
	ctx = metadata.NewIncomingContext(context.Background(), metadata.Pairs(clients.MetadataKey, "a", clients.MetadataKey, "b"))
	if _, err := clients.KeyFromMetadata(ctx); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("two values: %v, want INVALID_ARGUMENT", err)
	}
	if k, err := clients.KeyFromMetadata(context.Background()); k != "" || err != nil {
		t.Fatalf("no metadata: %q, %v", k, err)
	}
}

// Spellings that differ only in Unicode details normalize alike in Go, Node
// and Python: a byte-order mark, U+0085 NEXT LINE, and the full lower-case
// mapping of İ and of a word-final Σ.
func ExampleNormalizeName() {
	for _, name := range []string{"\uFEFFFlower Shop", "Flower\u0085Shop ", "İSTANBUL", "ΟΔΟΣ"} {
		fmt.Printf("%+q\n", clients.NormalizeName(name))
	}
	// Output:
	// "flower shop"
	// "flower shop"
	// "i\u0307stanbul"
	// "\u03bf\u03b4\u03bf\u03c2"
}
