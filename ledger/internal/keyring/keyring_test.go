package keyring_test

import (
	"bytes"
	"errors"
	"testing"

	"github.com/idemcoord/idemcoord/ledger/internal/keyring"
)

func ring(t *testing.T, active string, ids ...string) *keyring.Ring {
	t.Helper()
	keys := map[string][]byte{}
	for i, id := range ids {
		keys[id] = bytes.Repeat([]byte{byte(i + 1)}, keyring.KeySize)
	}
	r, err := keyring.New(active, keys)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// TestSealedOpensOnlyWhereBound: a sealed column opens with its own
// record, column and binding, and with nothing else.
func TestSealedOpensOnlyWhereBound(t *testing.T) {
	r := ring(t, "k1", "k1")
	id := keyring.ID{Tenant: "t", Scope: "s", Key: "k"}
	b := keyring.Binding{Generation: 1, Attempt: 2, Response: true, StatusCode: 200}
	sealed := r.Seal(id, "body", b, []byte("secret"))
	plain, err := r.Open("k1", id, "body", keyring.AdditionalData(id, "body", b), sealed)
	if err != nil || string(plain) != "secret" {
		t.Fatalf("open = %q, %v", plain, err)
	}
	later := b
	later.Generation = 2
	other := keyring.ID{Tenant: "t", Scope: "s", Key: "other"}
	for name, ad := range map[string][]byte{
		"another record":     keyring.AdditionalData(other, "body", b),
		"another column":     keyring.AdditionalData(id, "metadata", b),
		"a later generation": keyring.AdditionalData(id, "body", later),
	} {
		if _, err := r.Open("k1", id, "body", ad, sealed); err == nil {
			t.Errorf("opened with %s", name)
		}
	}
	if _, err := r.Open("gone", id, "body", keyring.AdditionalData(id, "body", b), sealed); !errors.Is(err, keyring.ErrUnknownKey) {
		t.Errorf("unknown key: err = %v, want ErrUnknownKey", err)
	}
}

// TestFingerprintSurvivesRotation: a fingerprint stored under an old key
// still matches after the active key changes; a different request does
// not.
func TestFingerprintSurvivesRotation(t *testing.T) {
	id := keyring.ID{Tenant: "t", Scope: "s", Key: "k"}
	stored := ring(t, "old", "old").FingerprintFor(id, nil, []byte("req"))
	rotated := ring(t, "new", "old", "new")
	if got := rotated.FingerprintFor(id, stored, []byte("req")); !bytes.Equal(got, stored) {
		t.Error("the same request no longer matches after rotation")
	}
	if got := rotated.FingerprintFor(id, stored, []byte("other")); bytes.Equal(got, stored) {
		t.Error("a different request matches")
	}
	var none *keyring.Ring
	if got := none.FingerprintFor(id, nil, []byte("req")); string(got) != "req" {
		t.Errorf("without a ring: %q, want the raw fingerprint", got)
	}
}
