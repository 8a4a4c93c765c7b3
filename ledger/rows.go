package ledger

import (
	"context"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemcoord/idemcoord/ledger/internal/keyring"
	"github.com/idemcoord/idemcoord/statemachine"
)

// insertOrRead runs the begin statement; a lock wait longer than lockWait fails it
// (isLockTimeout). found is false when no row came back. When ctx ends
// while the statement runs and it then creates the key, createdLate (if
// not nil) is called with the record it created.
func (s *Store) insertOrRead(ctx context.Context, id Identity, ev *statemachine.Event, lockWait time.Duration,
	createdLate func(statemachine.Record),
) (rec statemachine.Record, inserted bool, now time.Time, found bool, err error) {
	// The INSERT commits by itself: never cancelled by ctx (see
	// commitTimeout).
	type row struct {
		rec             statemachine.Record
		inserted, found bool
		now             time.Time
	}
	var late func(row, error)
	if createdLate != nil {
		late = func(r row, err error) {
			if err == nil && r.inserted {
				createdLate(r.rec)
			}
		}
	}
	r, err := detachedThen(ctx, func(cctx context.Context) (row, error) {
		var r row
		var err error
		r.rec, r.inserted, r.now, r.found, err = s.insertOrReadOnce(cctx, id, ev, lockWait)
		return r, err
	}, late)
	return r.rec, r.inserted, r.now, r.found, err
}

func (s *Store) insertOrReadOnce(ctx context.Context, id Identity, ev *statemachine.Event, lockWait time.Duration) (rec statemachine.Record, inserted bool, now time.Time, found bool, err error) {
	q := s.sql.begin(newRecordOf(id, *ev), s.newRowKeyID(), s.now(), lockWait)
	if q.local == "" {
		rows, err := s.pool.Query(ctx, q.sql, q.args...)
		if err != nil {
			return rec, false, now, false, err
		}
		return s.scanBegin(rows, id)
	}
	err = withTx(ctx, s.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, q.local); err != nil {
			return err
		}
		rows, err := tx.Query(ctx, q.sql, q.args...)
		if err != nil {
			return err
		}
		rec, inserted, now, found, err = s.scanBegin(rows, id)
		return err
	})
	return rec, inserted, now, found, err
}

// scanBegin reads the begin statement's row of the record id, if any, and
// closes rows.
func (s *Store) scanBegin(rows pgx.Rows, id Identity) (rec statemachine.Record, inserted bool, now time.Time, found bool, err error) {
	defer rows.Close()
	if !rows.Next() {
		return rec, false, now, false, rows.Err()
	}
	dest, fin := s.scanFullTargets(&rec, &id)
	if err := rows.Scan(append(append([]any{&inserted}, dest...), &now)...); err != nil {
		return rec, false, now, false, err
	}
	if err := fin(); err != nil {
		return rec, false, now, false, err
	}
	rows.Close()
	return rec, inserted, now.UTC(), true, rows.Err()
}

// scanFullRecordNow scans fullColumns of record id followed by the clock
// column.
func (s *Store) scanFullRecordNow(row pgx.Row, id Identity) (statemachine.Record, time.Time, error) {
	var rec statemachine.Record
	var now time.Time
	dest, fin := s.scanFullTargets(&rec, &id)
	if err := row.Scan(append(dest, &now)...); err != nil {
		return rec, now, err
	}
	if err := fin(); err != nil {
		return rec, now, err
	}
	return rec, now.UTC(), nil
}

// scanMode says how scanTargets treats a row it cannot open.
type scanMode int

const (
	// scanStrict fails with ErrUnreadable.
	scanStrict scanMode = iota
	// scanLenient returns the record without its sealed columns (response,
	// failure reason, fingerprint), for Forget, which must work on any row.
	scanLenient
	// scanList is scanLenient for listColumns, which leave the response
	// and the checkpoint's data out.
	scanList
)

// scanFullTargets returns scan destinations for fullColumns (the record
// with its checkpoint) and a function that moves the scanned values into
// rec, opening the sealed columns of the record *id (which the same Scan
// may fill in). A row that does not open fails ErrUnreadable.
func (s *Store) scanFullTargets(rec *statemachine.Record, id *Identity) ([]any, func() error) {
	return s.scanTargetsMode(rec, id, scanStrict, true)
}

// scanTargetsMode is scanTargets with the given treatment of rows that do
// not open, for fullColumns (listColumns with scanList) when full is set.
// The destinations live in one rowTargets, so a scanned row costs a few
// allocations instead of one per column.
func (s *Store) scanTargetsMode(rec *statemachine.Record, id *Identity, mode scanMode, full bool) ([]any, func() error) {
	t := &rowTargets{s: s, rec: rec, id: id, mode: mode}
	t.dest = [len(t.dest)]any{&t.state, &rec.Fingerprint, &rec.Attempt, &rec.Generation, &rec.LeaseToken,
		&rec.AttemptID, &t.acquiredFrom, &t.endedBy, &t.hasResponse, &t.schemaVersion, &t.contentType,
		&t.statusCode, &t.body, &t.metadata, &rec.FailureReason, &t.ttl, &t.failureTTL, &rec.CreatedAt,
		&rec.UpdatedAt, &t.leaseExpires, &t.expires, &t.keyID, &rec.Uncertain, &t.version,
		&t.cpPhase, &t.cpData, &t.cpAt, &t.cpAttempt}
	n := recordTargets
	if full {
		n += checkpointTargets
	}
	// The spare capacity takes a caller's appended column (the clock)
	// without copying.
	return t.dest[:n], t.finish
}

// recordTargets and checkpointTargets are how many of rowTargets' destinations
// the record's columns and the checkpoint's take.
const (
	recordTargets     = 24
	checkpointTargets = 4
)

// rowTargets holds the scan destinations of one row (see scanTargetsMode)
// until finish moves them into the record.
type rowTargets struct {
	s    *Store
	rec  *statemachine.Record
	id   *Identity
	mode scanMode

	state, acquiredFrom, endedBy int16
	hasResponse                  bool
	schemaVersion, contentType   string
	statusCode                   int32
	body, metadata               []byte
	ttl, failureTTL              int64
	leaseExpires, expires        *time.Time
	keyID                        string
	version                      int16
	cpPhase                      *string
	cpData                       []byte
	cpAt                         *time.Time
	cpAttempt                    *int32

	dest [recordTargets + checkpointTargets + 1]any
}

// finish moves the scanned values into the record, opening its sealed
// columns; a row that does not open fails ErrUnreadable in scanStrict
// mode, and otherwise is returned without its sealed columns.
func (t *rowTargets) finish() error {
	err := t.decode()
	if err == nil {
		return nil
	}
	if t.mode == scanStrict {
		return fmt.Errorf("%w: %w", ErrUnreadable, err)
	}
	t.s.logger.Warn("record unreadable; returned without its sealed columns", "tenant", t.id.Tenant, "scope", t.id.Scope, "err", err)
	t.rec.Response, t.rec.FailureReason, t.rec.Fingerprint, t.rec.Checkpoint = nil, "", nil, nil
	return nil
}

// decode moves the scanned values into the record and opens its sealed
// columns.
func (t *rowTargets) decode() error {
	t.rec.State = statemachine.State(t.state)
	t.rec.AcquiredFrom = statemachine.State(t.acquiredFrom)
	t.rec.EndedBy = statemachine.Ending(t.endedBy)
	t.rec.TTL = time.Duration(t.ttl) * time.Microsecond
	t.rec.FailureTTL = time.Duration(t.failureTTL) * time.Microsecond
	t.rec.CreatedAt = t.rec.CreatedAt.UTC()
	t.rec.UpdatedAt = t.rec.UpdatedAt.UTC()
	if t.leaseExpires != nil {
		t.rec.LeaseExpiresAt = t.leaseExpires.UTC()
	}
	if t.expires != nil {
		t.rec.ExpiresAt = t.expires.UTC()
	}
	o := opener{k: t.s.keyring, keyID: t.keyID, version: t.version, id: *t.id,
		b: keyring.Binding{Generation: t.rec.Generation, Attempt: t.rec.Attempt, EndedBy: t.endedBy}}
	if err := o.check(); err != nil {
		return err
	}
	if t.mode != scanList && o.sealed() && !t.hasResponse &&
		(t.rec.State == statemachine.StateCompleted || t.rec.State == statemachine.StateFailedReplayable) {
		return fmt.Errorf("ledger: %s record %q has no stored response", t.rec.State, t.id.Key)
	}
	var err error
	if t.rec.FailureReason, err = o.openReason(t.rec.FailureReason); err != nil {
		return err
	}
	t.rec.Fingerprint = o.fingerprint(t.rec.Fingerprint)
	if t.hasResponse {
		rb := o.b
		rb.Response, rb.State, rb.StatusCode, rb.SchemaVersion, rb.ContentType = true, t.state, t.statusCode, t.schemaVersion, t.contentType
		rb.HasMetadata = t.metadata != nil
		if t.body, err = o.open("body", rb, t.body); err != nil {
			return err
		}
		if t.metadata != nil {
			if t.metadata, err = o.open("metadata", rb, t.metadata); err != nil {
				return err
			}
		}
		r := &statemachine.Response{SchemaVersion: t.schemaVersion, ContentType: t.contentType,
			StatusCode: t.statusCode, Body: t.body}
		if len(t.metadata) > 0 {
			var err error
			if r.Metadata, err = decodeMetadata(t.metadata); err != nil {
				return err
			}
		}
		t.rec.Response = r
	}
	if t.cpPhase != nil {
		c := &statemachine.Checkpoint{Phase: *t.cpPhase}
		if t.cpAt != nil {
			c.At = t.cpAt.UTC()
		}
		if t.cpAttempt != nil {
			c.Attempt = *t.cpAttempt
		}
		if t.cpData != nil {
			if c.Data, err = o.openCheckpoint(t.rec.Generation, c.Attempt, t.cpData); err != nil {
				return err
			}
		}
		t.rec.Checkpoint = c
	}
	return nil
}

// opener opens the sealed columns of one scanned row.
type opener struct {
	k       *keyring.Ring
	keyID   string
	version int16
	id      Identity
	b       keyring.Binding
}

// sealed reports whether the row is in the current sealed form.
func (o *opener) sealed() bool { return o.keyID != "" && o.version >= keyring.SealVersion }

// legacy reports whether the row is in clear or sealed in the v1 form.
func (o *opener) legacy() bool { return !o.sealed() }

// check refuses a row the keyring may not read: any sealed row without a
// keyring; with one, a row in clear or in the v1 form (a downgrade: a
// database writer could write either) unless legacy rows are accepted.
func (o *opener) check() error {
	switch {
	case o.k == nil && o.keyID != "":
		return fmt.Errorf("%w: key id %q (encryption is off)", ErrUnknownKey, o.keyID)
	case o.k == nil:
		return nil
	case o.keyID == "" && !o.k.AcceptsLegacyRows():
		return errors.New("ledger: record stored in clear where encryption is required " +
			"(written while encryption was off, or altered; see encryption.accept_legacy_rows)")
	case o.legacy() && !o.k.AcceptsLegacyRows():
		return fmt.Errorf("ledger: record sealed in the legacy form (seal_version %d) where seal_version %d is required "+
			"(see encryption.accept_legacy_rows)", o.version, keyring.SealVersion)
	}
	return nil
}

// open opens one sealed response column.
func (o *opener) open(column string, b keyring.Binding, v []byte) ([]byte, error) {
	switch {
	case o.keyID == "":
		return v, nil // in clear: check allowed it
	case o.legacy():
		return o.k.Open(o.keyID, keyring.ID(o.id), column, keyring.LegacyAdditionalData(keyring.ID(o.id), column), v)
	}
	return o.k.Open(o.keyID, keyring.ID(o.id), column, keyring.AdditionalData(keyring.ID(o.id), column, b), v)
}

// checkpointBinding binds a checkpoint's sealed data to the record's
// generation and to the attempt that recorded it: what stays the same for
// as long as the checkpoint is kept, so rewrites of the row for other
// reasons need not seal it again under another binding.
func checkpointBinding(generation, attempt int32) keyring.Binding {
	return keyring.Binding{Generation: generation, Attempt: attempt}
}

// openCheckpoint opens the checkpoint's data (sealed in the current form
// only: no legacy row has a checkpoint).
func (o *opener) openCheckpoint(generation, attempt int32, v []byte) ([]byte, error) {
	if o.keyID == "" {
		return v, nil // in clear: check allowed it
	}
	if o.legacy() {
		return nil, fmt.Errorf("ledger: record %q has a checkpoint in a legacy row", o.id.Key)
	}
	return o.k.Open(o.keyID, keyring.ID(o.id), "checkpoint_data",
		keyring.AdditionalData(keyring.ID(o.id), "checkpoint_data", checkpointBinding(generation, attempt)), v)
}

// openReason opens the failure reason (stored base64-encoded when sealed;
// empty is stored as is).
func (o *opener) openReason(v string) (string, error) {
	if v == "" || !o.sealed() {
		return v, nil // legacy rows kept the reason in clear
	}
	sealed, err := base64.StdEncoding.DecodeString(v)
	if err != nil {
		return "", fmt.Errorf("ledger: failure_reason of %q is not sealed", o.id.Key)
	}
	plain, err := o.k.Open(o.keyID, keyring.ID(o.id), "failure_reason", keyring.AdditionalData(keyring.ID(o.id), "failure_reason", o.b), sealed)
	return string(plain), err
}

// fingerprint returns the stored fingerprint in the form Begin compares:
// as stored for current rows; keyed under the active key for a legacy
// row's raw fingerprint when a keyring reads it.
func (o *opener) fingerprint(v []byte) []byte {
	if len(v) == 0 {
		return nil
	}
	if o.k != nil && o.legacy() {
		return o.k.KeyedFingerprint(o.k.ActiveKeyID(), keyring.ID(o.id), v)
	}
	return v
}

// newRowKeyID is the enc_key_id of rows written now: the active key, or ""
// (in clear) without a keyring.
func (s *Store) newRowKeyID() string {
	if s.keyring == nil {
		return ""
	}
	return s.keyring.ActiveKeyID()
}

// responseArgs returns the stored form of a response of record id. With a keyring, body and metadata are sealed with the
// active key and bound by b (whose response part responseArgs fills in);
// b may be nil only without a keyring.
func (s *Store) responseArgs(id Identity, r *statemachine.Response, b *keyring.Binding) (storedResponse, error) {
	keyID := s.newRowKeyID()
	if r == nil {
		return storedResponse{keyID: keyID}, nil
	}
	body := r.Body
	if body == nil {
		body = []byte{}
	}
	var metadata []byte
	if len(r.Metadata) > 0 {
		metadata = encodeMetadata(r.Metadata)
	}
	if s.keyring != nil {
		if b == nil {
			return storedResponse{}, errors.New("ledger: sealing a response without its record's binding")
		}
		rb := *b
		rb.Response, rb.StatusCode, rb.SchemaVersion, rb.ContentType = true, r.StatusCode, r.SchemaVersion, r.ContentType
		rb.HasMetadata = metadata != nil
		body = s.keyring.Seal(keyring.ID(id), "body", rb, body)
		if metadata != nil {
			metadata = s.keyring.Seal(keyring.ID(id), "metadata", rb, metadata)
		}
	}
	return storedResponse{has: true, schemaVersion: r.SchemaVersion, contentType: r.ContentType,
		statusCode: r.StatusCode, body: body, metadata: metadata, keyID: keyID}, nil
}

// metadataFormat is the first byte of metadata in its stored form: the
// entries sorted by name, each as uvarint length + name + uvarint length +
// value. The stored form is never larger than the same map in the
// protobuf encoding of the request, so the response limit (which counts
// the protobuf encoding) bounds the stored bytes. Rows written before it
// hold a JSON object, which starts with '{' and is still read.
const metadataFormat = 0x01

// encodeMetadata returns the stored form of m (non-empty).
func encodeMetadata(m map[string]string) []byte {
	size := 1
	for k, v := range m {
		size += 2*binary.MaxVarintLen64 + len(k) + len(v)
	}
	out := make([]byte, 1, size)
	out[0] = metadataFormat
	for _, k := range slices.Sorted(maps.Keys(m)) {
		out = binary.AppendUvarint(out, uint64(len(k)))
		out = append(out, k...)
		out = binary.AppendUvarint(out, uint64(len(m[k])))
		out = append(out, m[k]...)
	}
	return out
}

// decodeMetadata reads metadata in its stored form, or as the JSON object
// of older rows.
func decodeMetadata(b []byte) (map[string]string, error) {
	m := map[string]string{}
	if b[0] == '{' {
		if err := json.Unmarshal(b, &m); err != nil {
			return nil, fmt.Errorf("ledger: decode stored metadata: %w", err)
		}
		return m, nil
	}
	if b[0] != metadataFormat {
		return nil, fmt.Errorf("ledger: stored metadata in unknown format %#x", b[0])
	}
	b = b[1:]
	next := func() (string, bool) {
		n, w := binary.Uvarint(b)
		if w <= 0 || n > uint64(len(b)-w) {
			return "", false
		}
		v := string(b[w : w+int(n)])
		b = b[w+int(n):]
		return v, true
	}
	for len(b) > 0 {
		k, ok := next()
		v, ok2 := next()
		if !ok || !ok2 {
			return nil, errors.New("ledger: stored metadata is truncated")
		}
		m[k] = v
	}
	return m, nil
}

// recordArgs returns the values of fullColumns for rec, the record id,
// with its sensitive columns (the checkpoint's data included) sealed when
// there is a keyring: the fingerprint is already in its stored form (see
// keyring.Ring.FingerprintFor).
func (s *Store) recordArgs(id Identity, rec statemachine.Record) ([]any, error) {
	b := keyring.Binding{Generation: rec.Generation, Attempt: rec.Attempt, EndedBy: int16(rec.EndedBy), State: int16(rec.State)}
	resp, err := s.responseArgs(id, rec.Response, &b)
	if err != nil {
		return nil, err
	}
	reason := rec.FailureReason
	if s.keyring != nil && reason != "" {
		reason = base64.StdEncoding.EncodeToString(s.keyring.Seal(keyring.ID(id), "failure_reason", b, []byte(reason)))
	}
	var cpPhase *string
	var cpData []byte
	var cpAt *time.Time
	var cpAttempt *int32
	if c := rec.Checkpoint; c != nil {
		cpPhase, cpAt, cpAttempt = &c.Phase, &c.At, &c.Attempt
		cpData = c.Data
		if cpData == nil {
			cpData = []byte{}
		}
		if s.keyring != nil {
			cpData = s.keyring.Seal(keyring.ID(id), "checkpoint_data", checkpointBinding(rec.Generation, c.Attempt), cpData)
		}
	}
	return []any{int16(rec.State), storedFingerprint(rec.Fingerprint), rec.Attempt, rec.Generation, rec.LeaseToken, rec.AttemptID,
		int16(rec.AcquiredFrom), int16(rec.EndedBy), resp.has, resp.schemaVersion, resp.contentType, resp.statusCode,
		resp.body, resp.metadata, reason, rec.TTL.Microseconds(), rec.FailureTTL.Microseconds(), rec.CreatedAt,
		rec.UpdatedAt, optTime(rec.LeaseExpiresAt), optTime(rec.ExpiresAt), resp.keyID, rec.Uncertain, int16(keyring.SealVersion),
		cpPhase, cpData, cpAt, cpAttempt}, nil
}

func optTime(t time.Time) *time.Time {
	if t.IsZero() {
		return nil
	}
	return &t
}
