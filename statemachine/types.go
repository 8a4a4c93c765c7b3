package statemachine

import (
	"bytes"
	"maps"
	"strconv"
	"time"
)

// State is the state of a record. The numbers match the State enum of the
// idempotency.v1 API.
type State uint8

// The states of a record. StateNone stands for "no record".
const (
	StateNone             State = 0
	StateInProgress       State = 1
	StateCompleted        State = 2
	StateFailedRetryable  State = 3
	StateFailedReplayable State = 4
	StateExpired          State = 5
	StateUnknown          State = 6
)

var stateNames = [...]string{"NONE", "IN_PROGRESS", "COMPLETED", "FAILED_RETRYABLE", "FAILED_REPLAYABLE", "EXPIRED", "UNKNOWN"}

// String returns the state's name as in the API without the prefix.
func (s State) String() string {
	if int(s) < len(stateNames) {
		return stateNames[s]
	}
	return "State(" + strconv.Itoa(int(s)) + ")"
}

// Terminal reports whether s is an ended state that expires: COMPLETED or
// FAILED_*.
func (s State) Terminal() bool {
	return s == StateCompleted || s == StateFailedRetryable || s == StateFailedReplayable
}

// Replayable reports whether Begin replays a record in state s.
func (s State) Replayable() bool {
	return s == StateCompleted || s == StateFailedReplayable
}

// FailureKind says what a failed attempt means. The numbers match the
// FailureKind enum of the idempotency.v1 API.
type FailureKind uint8

// The kinds of failure.
const (
	// FailureRetryable: nothing happened; the next Begin runs it again.
	FailureRetryable FailureKind = 1
	// FailureReplayable: a final answer, stored and replayed.
	FailureReplayable FailureKind = 2
	// FailureUnknown: the side effect may have happened.
	FailureUnknown FailureKind = 3
	// FailureAbandoned: the attempt never started its work (a request
	// rejected before it did anything, or a Begin whose caller gave up
	// before the handler ran). The key goes back to how it was before the
	// acquisition, and the attempt does not count against max_attempts;
	// see Next for what the record can and cannot restore.
	FailureAbandoned FailureKind = 4
)

// Valid reports whether k is one of the defined kinds.
func (k FailureKind) Valid() bool { return k >= FailureRetryable && k <= FailureAbandoned }

// Ending records which call ended the current acquisition, so a repeat of
// that call can be recognised.
type Ending uint8

// The endings. The failure endings share the numbers of FailureKind.
const (
	EndingNone       Ending = 0
	EndingRetryable  Ending = Ending(FailureRetryable)
	EndingReplayable Ending = Ending(FailureReplayable)
	EndingUnknown    Ending = Ending(FailureUnknown)
	EndingAbandoned  Ending = Ending(FailureAbandoned)
	EndingCompleted  Ending = 5
	// EndingResolved: an operator resolved the record (EventResolve) as
	// COMPLETED. (Records resolved as FAILED_RETRYABLE before
	// EndingResolvedRetryable existed carry it too, with ResolvedReason.)
	EndingResolved Ending = 6
	// EndingResolvedRetryable: an operator resolved the record as
	// FAILED_RETRYABLE.
	EndingResolvedRetryable Ending = 7
)

// failure reports whether a record ended by e (with failure reason
// reason) ended as FAILED_RETRYABLE: a failure, not a result.
func (e Ending) failure(reason string) bool {
	switch e {
	case EndingRetryable, EndingAbandoned, EndingResolvedRetryable:
		return true
	case EndingResolved:
		return reason == ResolvedReason
	}
	return false
}

// OnExpired is the policy for a Begin that finds an expired record.
type OnExpired uint8

// The on_expired policies.
const (
	// ExpiredRestart starts a new generation.
	ExpiredRestart OnExpired = iota
	// ExpiredReject refuses with ErrKeyExpired.
	ExpiredReject
)

// OnUnknown is the policy for a Begin that finds an UNKNOWN record.
type OnUnknown uint8

// The on_unknown policies.
const (
	// UnknownTakeover lets the next Begin acquire the key.
	UnknownTakeover OnUnknown = iota
	// UnknownHold keeps the key held until an operator resolves it.
	UnknownHold
)

// Policy holds the parts of a scope's policy that decide transitions.
// Durations a request may override are passed in the Event instead.
type Policy struct {
	OnExpired OnExpired
	OnUnknown OnUnknown
	// MaxAttempts > 0 refuses a takeover once that many attempts were made.
	// Abandoned attempts (Fail ABANDONED) do not count.
	MaxAttempts int32
}

// Response is a stored operation result, kept and replayed byte for byte.
type Response struct {
	SchemaVersion string
	ContentType   string
	Body          []byte
	StatusCode    int32
	Metadata      map[string]string
}

// Equal reports whether r and o hold the same content. Two nil responses are
// equal; a nil and a non-nil one are not (as with proto.Equal); nil and empty
// byte slices and maps are equal.
func (r *Response) Equal(o *Response) bool {
	if r == nil || o == nil {
		return r == nil && o == nil
	}
	return r.SchemaVersion == o.SchemaVersion && r.ContentType == o.ContentType &&
		bytes.Equal(r.Body, o.Body) && r.StatusCode == o.StatusCode &&
		maps.Equal(r.Metadata, o.Metadata)
}

// Checkpoint is a recovery point: the last step of a multi-step operation
// that an attempt of the record's generation recorded it had finished.
type Checkpoint struct {
	// Phase names the step.
	Phase string
	// Data is what the next attempt needs to resume after it.
	Data []byte
	// At is when it was recorded (ignored in an Event).
	At time.Time
	// Attempt is the number of the attempt that recorded it (ignored in
	// an Event): that attempt may not end Fail ABANDONED. It is 0 once
	// that number names a later acquisition: a Fail ABANDONED of a
	// takeover gives its number back to the record.
	Attempt int32
}

// Equal reports whether c and o hold the same checkpoint. Two nil
// checkpoints are equal; nil and empty data are equal.
func (c *Checkpoint) Equal(o *Checkpoint) bool {
	if c == nil || o == nil {
		return c == nil && o == nil
	}
	return c.Phase == o.Phase && bytes.Equal(c.Data, o.Data) && c.At.Equal(o.At) && c.Attempt == o.Attempt
}

// Record is one idempotency record. A zero time means "unset".
type Record struct {
	State       State
	Fingerprint []byte
	Attempt     int32
	Generation  int32
	// LeaseToken is the fencing token of the latest acquisition.
	LeaseToken string
	// AttemptID is the attempt_id of the latest acquisition.
	AttemptID string
	// AcquiredFrom is the state the latest acquisition found (the
	// previous_state it answered).
	AcquiredFrom State
	// EndedBy is the call that ended the latest acquisition, if any.
	EndedBy Ending
	// Uncertain reports that an attempt of this generation may have done
	// the side effect: its lease lapsed, or it ended Fail UNKNOWN. It stays
	// set until the generation ends COMPLETED or FAILED_REPLAYABLE or an
	// operator resolves the record, so every later acquisition of the
	// generation answers previous_state UNKNOWN. Every record that reads
	// UNKNOWN is uncertain.
	Uncertain     bool
	Response      *Response
	FailureReason string
	// Checkpoint is the generation's last checkpoint, or nil. It outlives
	// the attempt that recorded it (a takeover resumes after it) and the
	// end of the generation (for audit), until the record expires.
	Checkpoint *Checkpoint
	// TTL and FailureTTL are the retention windows chosen at acquisition;
	// they count from the ending call.
	TTL            time.Duration
	FailureTTL     time.Duration
	CreatedAt      time.Time
	UpdatedAt      time.Time
	LeaseExpiresAt time.Time
	ExpiresAt      time.Time
}

// NeedsDecision reports whether r (as in effect now: see Effective) waits
// for somebody to find out what an earlier attempt did: it reads UNKNOWN,
// or it is a FAILED_RETRYABLE record of an uncertain generation. Such
// records never expire; an operator's Resolve ends them.
func (r Record) NeedsDecision() bool {
	return r.State == StateUnknown || r.State == StateFailedRetryable && r.Uncertain
}

// EventKind names an event.
type EventKind uint8

// The events.
const (
	EventBegin EventKind = iota + 1
	EventComplete
	EventFail
	EventHeartbeat
	// EventResolve is an operator's decision on an UNKNOWN record after
	// checking the outside world: it ends the record as COMPLETED (with
	// Event.Response) or FAILED_RETRYABLE, as Event.ResolveAs says.
	EventResolve
)

// Event is a call on a record. Fields that do not apply to its Kind are
// ignored.
type Event struct {
	Kind EventKind

	// Begin.
	Fingerprint          []byte
	AttemptID            string
	AcceptSchemaVersions []string
	// NewToken is the lease token an acquisition by this Begin gets.
	NewToken string
	// TTL and FailureTTL (Begin) are the retention windows for this
	// acquisition, already resolved from the request and the policy.
	TTL        time.Duration
	FailureTTL time.Duration
	// Lease (Begin, Heartbeat) is the lease length, already resolved.
	Lease time.Duration
	// Checkpoint (Heartbeat), when set, is the step the holder has just
	// finished: it becomes the record's checkpoint, recorded by the
	// holder's attempt at the time of the event.
	Checkpoint *Checkpoint

	// Complete, Fail, Heartbeat.
	Token string
	// Fail.
	FailureKind FailureKind
	// Complete, Fail, Resolve. A nil Response on Complete, or on Resolve as
	// COMPLETED, is stored as empty.
	Response *Response
	Reason   string

	// Resolve. ResolveAs is the state an UNKNOWN record is resolved to:
	// StateCompleted or StateFailedRetryable.
	ResolveAs State
}

// Outcome is what Begin tells the caller. The numbers match the Outcome enum
// of the idempotency.v1 API.
type Outcome uint8

// The outcomes. OutcomeOK is the answer of a successful non-Begin event.
const (
	OutcomeOK         Outcome = 0
	OutcomeAcquired   Outcome = 1
	OutcomeReplay     Outcome = 2
	OutcomeInProgress Outcome = 3
)

// Write says what the store must do to apply a Decision.
type Write uint8

// The writes.
const (
	WriteNone Write = iota
	WriteInsert
	WriteUpdate
	WriteDelete
)
