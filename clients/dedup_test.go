package clients_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"strings"
	"testing"

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
	} {
		if got := clients.NormalizeName(in); got != want {
			t.Errorf("NormalizeName(%q) = %q, want %q", in, got, want)
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
