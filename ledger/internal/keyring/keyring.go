package keyring

import (
	"bytes"
	"crypto/aes"
	"crypto/cipher"
	"crypto/hkdf"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"maps"
	"slices"
)

// ID names a record, as the ledger's Identity does.
type ID struct {
	Tenant string
	Scope  string
	Key    string
}

// KeySize is the size of an encryption key: AES-256.
const KeySize = 32

// ErrUnknownKey is returned when a stored row was encrypted with a key id
// the Ring does not hold.
var ErrUnknownKey = errors.New("record encrypted with a key that is not configured")

// SealVersion is the seal_version this code writes. A row is in the current
// form when its enc_key_id is set and its seal_version is SealVersion; every
// other row (in clear, or sealed before the associated data bound the
// record's counters and clear columns) is a legacy row, which a keyring
// refuses unless it accepts legacy rows.
const SealVersion = 2

// Ring holds the AES-256-GCM keys that encrypt a record's sensitive
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
type Ring struct {
	active string
	aeads  map[string]cipher.AEAD
	// fpKeys are the fingerprint HMAC keys derived from each key.
	fpKeys map[string][]byte
	// legacy: rows in clear or in the v1 form are read (and converted
	// when written) instead of refused.
	legacy bool
}

// New builds a ring from keys (id → 32-byte key) with active as the key
// for new rows.
func New(active string, keys map[string][]byte) (*Ring, error) {
	if _, ok := keys[active]; !ok {
		return nil, fmt.Errorf("ledger: active key %q is not among the keys", active)
	}
	k := &Ring{active: active, aeads: map[string]cipher.AEAD{}, fpKeys: map[string][]byte{}}
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
		fpKey, err := hkdf.Key(sha256.New, key, nil, "idemcoord/v2 fingerprint", sha256.Size)
		if err != nil {
			return nil, fmt.Errorf("ledger: key %q: %w", id, err)
		}
		k.fpKeys[id] = fpKey
	}
	return k, nil
}

// AcceptingLegacyRows returns a copy of k that reads legacy rows (in
// clear, or sealed before seal_version 2, with raw fingerprints) instead
// of refusing them.
func (k *Ring) AcceptingLegacyRows() *Ring {
	c := *k
	c.legacy = true
	return &c
}

// AcceptsLegacyRows reports whether k reads legacy rows.
func (k *Ring) AcceptsLegacyRows() bool { return k != nil && k.legacy }

// ActiveKeyID returns the id of the key that seals new rows.
func (k *Ring) ActiveKeyID() string { return k.active }

// KeyIDs returns the ids of every key in the ring, sorted.
func (k *Ring) KeyIDs() []string {
	return slices.Sorted(maps.Keys(k.aeads))
}

// Binding is what a sealed column is bound to besides its record and
// column: the record's generation, attempt and ending and, for the
// response's body and metadata (response true), its state, the response
// columns stored in clear and whether it has metadata. The failure reason is not bound to the state:
// the reaper moves FAILED_* records to EXPIRED without the keys; the ending,
// which it never changes, says how the attempt ended.
type Binding struct {
	Generation, Attempt int32
	EndedBy             int16

	Response      bool
	State         int16
	StatusCode    int32
	SchemaVersion string
	ContentType   string
	HasMetadata   bool // so the metadata cannot be dropped unnoticed
}

// AdditionalData is the associated data of a sealed column: a version tag,
// then every bound value, length-prefixed so no two bindings encode alike.
func AdditionalData(id ID, column string, b Binding) []byte {
	out := []byte("idemcoord/v2")
	str := func(s string) {
		out = binary.AppendUvarint(out, uint64(len(s)))
		out = append(out, s...)
	}
	str(id.Tenant)
	str(id.Scope)
	str(id.Key)
	str(column)
	out = binary.BigEndian.AppendUint32(out, uint32(b.Generation))
	out = binary.BigEndian.AppendUint32(out, uint32(b.Attempt))
	out = binary.BigEndian.AppendUint16(out, uint16(b.EndedBy))
	if b.Response {
		out = append(out, 1)
		out = binary.BigEndian.AppendUint16(out, uint16(b.State))
		out = binary.BigEndian.AppendUint32(out, uint32(b.StatusCode))
		str(b.SchemaVersion)
		str(b.ContentType)
		if b.HasMetadata {
			out = append(out, 1)
		} else {
			out = append(out, 0)
		}
	} else {
		out = append(out, 0)
	}
	return out
}

// LegacyAdditionalData is the associated data of rows sealed before
// seal_version 2: record and column only.
func LegacyAdditionalData(id ID, column string) []byte {
	return []byte("idemcoord/v1\x1f" + id.Tenant + "\x1f" + id.Scope + "\x1f" + id.Key + "\x1f" + column)
}

// Seal encrypts plaintext with the active key: nonce || ciphertext+tag.
func (k *Ring) Seal(id ID, column string, b Binding, plaintext []byte) []byte {
	aead := k.aeads[k.active]
	out := make([]byte, aead.NonceSize(), aead.NonceSize()+len(plaintext)+aead.Overhead())
	_, _ = rand.Read(out) // crypto/rand.Read never fails
	return aead.Seal(out, out, plaintext, AdditionalData(id, column, b))
}

// Open decrypts a value sealed under keyID with the associated data ad.
// The error names the column and key id, never the contents.
func (k *Ring) Open(keyID string, id ID, column string, ad []byte, sealed []byte) ([]byte, error) {
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
	plain, err := aead.Open(nil, sealed[:aead.NonceSize()], sealed[aead.NonceSize():], ad)
	if err != nil {
		return nil, fmt.Errorf("ledger: %s of %q does not open with key %q (altered, or moved from elsewhere): %w", column, id.Key, keyID, err)
	}
	return plain, nil
}

// KeyedFingerprint is the stored form of the caller's fingerprint fp of
// record id under key keyID: HMAC-SHA-256 over the record's identity and
// fp, so equal requests of different records do not hash alike either.
func (k *Ring) KeyedFingerprint(keyID string, id ID, fp []byte) []byte {
	mac := hmac.New(sha256.New, k.fpKeys[keyID])
	for _, s := range []string{id.Tenant, id.Scope, id.Key} {
		_ = binary.Write(mac, binary.BigEndian, uint32(len(s)))
		mac.Write([]byte(s))
	}
	mac.Write(fp)
	return mac.Sum(nil)
}

// FingerprintFor returns the form of the caller's fingerprint raw to compare
// with, and store in, record id whose stored fingerprint is stored: the
// stored value itself when raw hashes to it under any key of the ring (so
// rotation keeps matching), else raw keyed under the active key. Without a
// keyring, and for an empty fingerprint, it is raw.
func (k *Ring) FingerprintFor(id ID, stored, raw []byte) []byte {
	if k == nil || len(raw) == 0 {
		return raw
	}
	if len(stored) > 0 {
		for keyID := range k.fpKeys {
			if h := k.KeyedFingerprint(keyID, id, raw); hmac.Equal(h, stored) {
				return bytes.Clone(stored)
			}
		}
	}
	return k.KeyedFingerprint(k.active, id, raw)
}
