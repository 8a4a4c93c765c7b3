package ledger

import "github.com/idemcoord/idemcoord/ledger/internal/keyring"

// KeySize is the size of an encryption key: AES-256.
const KeySize = keyring.KeySize

// ErrUnknownKey is returned when a stored row was encrypted with a key id
// the Keyring does not hold.
var ErrUnknownKey = keyring.ErrUnknownKey

// Keyring holds the AES-256-GCM keys that encrypt a record's sensitive
// columns at rest: the stored response's body and metadata and the failure
// reason. New rows are sealed with the active key; rows written under older
// keys stay readable as long as their key is in the ring, so keys can be
// rotated without rewriting the table.
//
// Each ciphertext is bound (as AEAD associated data) to its record (tenant,
// scope, key), its column, the record's generation, attempt and ending,
// and, for the response, the record's state and the response columns kept
// in clear (status code, schema version, content type): a ciphertext copied
// to another row, moved to a later generation, or left beside an altered
// clear column does not open. Fingerprints are stored as keyed hashes
// (HMAC-SHA-256 under a key derived from a ring key), so a reader of the
// table cannot test guesses of a request against them.
type Keyring struct {
	ring *keyring.Ring
}

// NewKeyring builds a keyring from keys (id → 32-byte key) with active as
// the key for new rows.
func NewKeyring(active string, keys map[string][]byte) (*Keyring, error) {
	r, err := keyring.New(active, keys)
	if err != nil {
		return nil, err
	}
	return &Keyring{ring: r}, nil
}

// AcceptingLegacyRows returns a copy of k that reads legacy rows instead of
// refusing them: rows stored in clear (written while encryption was off) and
// rows sealed by versions before seal_version 2 (whose associated data did
// not bind generation, attempt, state and the clear columns, and whose
// fingerprints are raw). Every such row that is written again is stored in
// the current form, and Store.ConvertLegacyRows converts the rest. It is for
// the upgrade window only: while it is on, a database writer can plant rows
// in clear that are served.
func (k *Keyring) AcceptingLegacyRows() *Keyring {
	return &Keyring{ring: k.ring.AcceptingLegacyRows()}
}

// AcceptsLegacyRows reports whether k reads legacy rows.
func (k *Keyring) AcceptsLegacyRows() bool { return k != nil && k.ring.AcceptsLegacyRows() }

// ActiveKeyID returns the id of the key that seals new rows.
func (k *Keyring) ActiveKeyID() string { return k.ring.ActiveKeyID() }

// KeyIDs returns the ids of every key in the ring, sorted.
func (k *Keyring) KeyIDs() []string { return k.ring.KeyIDs() }

// ringOf is k's ring, nil without a keyring.
func ringOf(k *Keyring) *keyring.Ring {
	if k == nil {
		return nil
	}
	return k.ring
}
