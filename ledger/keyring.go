package ledger

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"errors"
	"fmt"
	"maps"
	"slices"
)

// KeySize is the size of an encryption key: AES-256.
const KeySize = 32

// ErrUnknownKey is returned when a stored row was encrypted with a key id
// the Keyring does not hold.
var ErrUnknownKey = errors.New("record encrypted with a key that is not configured")

// Keyring holds the AES-256-GCM keys that encrypt stored responses (body and
// metadata) at rest. New rows are encrypted with the active key; rows
// written under older keys stay readable as long as their key is in the
// ring, so keys can be rotated without rewriting the table. Each ciphertext
// is bound to its record and column, so ciphertexts cannot be swapped
// between rows.
type Keyring struct {
	active string
	aeads  map[string]cipher.AEAD
}

// NewKeyring builds a keyring from keys (id → 32-byte key) with active as
// the key for new rows.
func NewKeyring(active string, keys map[string][]byte) (*Keyring, error) {
	if _, ok := keys[active]; !ok {
		return nil, fmt.Errorf("ledger: active key %q is not among the keys", active)
	}
	k := &Keyring{active: active, aeads: map[string]cipher.AEAD{}}
	for id, key := range keys {
		if id == "" {
			return nil, errors.New("ledger: an encryption key needs a non-empty id")
		}
		if len(key) != KeySize {
			return nil, fmt.Errorf("ledger: key %q is %d bytes, want %d (AES-256)", id, len(key), KeySize)
		}
		block, err := aes.NewCipher(key)
		if err != nil {
			return nil, fmt.Errorf("ledger: key %q: %w", id, err)
		}
		aead, err := cipher.NewGCM(block)
		if err != nil {
			return nil, fmt.Errorf("ledger: key %q: %w", id, err)
		}
		k.aeads[id] = aead
	}
	return k, nil
}

// ActiveKeyID returns the id of the key that seals new rows.
func (k *Keyring) ActiveKeyID() string { return k.active }

// KeyIDs returns the ids of every key in the ring, sorted.
func (k *Keyring) KeyIDs() []string {
	return slices.Sorted(maps.Keys(k.aeads))
}

// additionalData binds a ciphertext to its record and column.
func additionalData(id Identity, column string) []byte {
	return []byte("idemcoord/v1\x1f" + id.Tenant + "\x1f" + id.Scope + "\x1f" + id.Key + "\x1f" + column)
}

// seal encrypts plaintext with the active key: nonce || ciphertext+tag.
func (k *Keyring) seal(id Identity, column string, plaintext []byte) []byte {
	aead := k.aeads[k.active]
	out := make([]byte, aead.NonceSize(), aead.NonceSize()+len(plaintext)+aead.Overhead())
	_, _ = rand.Read(out) // crypto/rand.Read never fails
	return aead.Seal(out, out, plaintext, additionalData(id, column))
}

// open decrypts a value sealed under keyID.
func (k *Keyring) open(keyID string, id Identity, column string, sealed []byte) ([]byte, error) {
	var aead cipher.AEAD
	if k != nil {
		aead = k.aeads[keyID]
	}
	if aead == nil {
		return nil, fmt.Errorf("%w: key id %q", ErrUnknownKey, keyID)
	}
	if len(sealed) < aead.NonceSize() {
		return nil, fmt.Errorf("ledger: %s of %q: ciphertext too short", column, id.Key)
	}
	plain, err := aead.Open(nil, sealed[:aead.NonceSize()], sealed[aead.NonceSize():], additionalData(id, column))
	if err != nil {
		return nil, fmt.Errorf("ledger: %s of %q: decryption with key %q failed: %w", column, id.Key, keyID, err)
	}
	return plain, nil
}
