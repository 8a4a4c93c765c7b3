package server

import (
	"errors"
	"fmt"
	"regexp"
	"time"
	"unicode/utf8"

	"buf.build/go/protovalidate"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
)

// Limits on request fields that are not configurable.
const (
	maxAcceptSchemaVersions = 32
	maxSchemaVersionBytes   = 255
)

// violations collects field violations of one request.
type violations struct {
	list   []*errdetails.BadRequest_FieldViolation
	reason idempotencyv1.ErrorReason
}

func (v *violations) addf(field, format string, args ...any) {
	v.list = append(v.list, &errdetails.BadRequest_FieldViolation{Field: field, Description: fmt.Sprintf(format, args...)})
}

func (v *violations) err() error {
	if len(v.list) == 0 {
		return nil
	}
	return &invalidError{violations: v.list, reason: v.reason}
}

// validate runs the proto's protovalidate rules on msg and then check, and
// returns an *invalidError listing every violation, or nil.
func validate(pv protovalidate.Validator, msg proto.Message, check func(*violations)) error {
	var v violations
	if !checkWireFaults(&v, msg) {
		return v.err()
	}
	if err := pv.Validate(msg); err != nil {
		var verr *protovalidate.ValidationError
		if !errors.As(err, &verr) {
			return fmt.Errorf("validate %T: %w", msg, err)
		}
		for _, viol := range verr.Violations {
			v.addf(protovalidate.FieldPathString(viol.Proto.GetField()), "%s", viol.Proto.GetMessage())
		}
	}
	check(&v)
	return v.err()
}

// checkWireFaults adds a violation for each string field of msg that the
// codec found invalid UTF-8 in, and reports whether msg was well-formed
// protobuf at all (if not, it adds that and stops).
func checkWireFaults(v *violations, msg proto.Message) (wellFormed bool) {
	for _, path := range invalidUTF8Paths(msg) {
		if path == malformedMessage {
			v.addf("", "the request is not a well-formed protobuf message")
			return false
		}
		v.addf(path, "must be valid UTF-8")
	}
	return true
}

// checkName checks a scope or key beyond the proto rules (non-empty, no
// control characters): at most maxBytes bytes of valid UTF-8.
func checkName(v *violations, field, s string, maxBytes int) {
	if len(s) > maxBytes {
		v.addf(field, "must be at most %d bytes, got %d", maxBytes, len(s))
	}
	if !utf8.ValidString(s) {
		v.addf(field, "must be valid UTF-8")
	}
}

// checkKeyFormat checks key against its scope's key_pattern (nil: any
// key); a mismatch is reason KEY_FORMAT.
func checkKeyFormat(v *violations, key string, pattern *regexp.Regexp) {
	if pattern == nil || pattern.MatchString(key) {
		return
	}
	v.addf("key", "does not have the format this scope's policy requires (key_pattern)")
	v.reason = idempotencyv1.ErrorReason_ERROR_REASON_KEY_FORMAT
}

// checkDuration checks an optional duration against [lo, hi]; loOpen makes
// the lower bound exclusive.
func checkDuration(v *violations, field string, d *durationpb.Duration, lo, hi time.Duration, loOpen bool) {
	if d == nil {
		return
	}
	if err := d.CheckValid(); err != nil {
		v.addf(field, "not a valid duration: %v", err)
		return
	}
	got := d.AsDuration()
	switch {
	case loOpen && got <= lo:
		v.addf(field, "must be more than %v, got %v", lo, got)
	case !loOpen && got < lo:
		v.addf(field, "must be at least %v, got %v", lo, got)
	case got > hi:
		v.addf(field, "must be at most %v, got %v", hi, got)
	}
}

// checkResponse checks a stored response's size.
func checkResponse(v *violations, field string, r *idempotencyv1.StoredResponse, lim Limits) {
	if r == nil {
		return
	}
	if n := proto.Size(r); n > lim.MaxResponseBytes {
		v.addf(field, "stored response must be at most %d bytes, got %d", lim.MaxResponseBytes, n)
		v.reason = idempotencyv1.ErrorReason_ERROR_REASON_RESPONSE_TOO_LARGE
	}
}

func (s *Server) validateBegin(req *idempotencyv1.BeginRequest, pol Policy, lim Limits) error {
	return validate(s.validator, req, func(v *violations) {
		checkName(v, "scope", req.GetScope(), lim.MaxScopeBytes)
		checkName(v, "key", req.GetKey(), lim.MaxKeyBytes)
		checkKeyFormat(v, req.GetKey(), pol.KeyPattern)
		if n := len(req.GetFingerprint()); n > lim.MaxFingerprintBytes {
			v.addf("fingerprint", "must be at most %d bytes, got %d", lim.MaxFingerprintBytes, n)
		}
		checkDuration(v, "ttl", req.GetTtl(), 0, pol.MaxTTL, true)
		checkDuration(v, "lease", req.GetLease(), lim.MinLease, lim.MaxLease, false)
		checkDuration(v, "wait", req.GetWait(), 0, lim.MaxWait, false)
		if n := len(req.GetAcceptSchemaVersions()); n > maxAcceptSchemaVersions {
			v.addf("accept_schema_versions", "at most %d entries, got %d", maxAcceptSchemaVersions, n)
		}
		for i, sv := range req.GetAcceptSchemaVersions() {
			if len(sv) > maxSchemaVersionBytes {
				v.addf(fmt.Sprintf("accept_schema_versions[%d]", i), "must be at most %d bytes", maxSchemaVersionBytes)
			}
		}
	})
}

func (s *Server) validateComplete(req *idempotencyv1.CompleteRequest, lim Limits) error {
	return validate(s.validator, req, func(v *violations) {
		checkName(v, "scope", req.GetScope(), lim.MaxScopeBytes)
		checkName(v, "key", req.GetKey(), lim.MaxKeyBytes)
		checkResponse(v, "response", req.GetResponse(), lim)
	})
}

func (s *Server) validateFail(req *idempotencyv1.FailRequest, lim Limits) error {
	return validate(s.validator, req, func(v *violations) {
		checkName(v, "scope", req.GetScope(), lim.MaxScopeBytes)
		checkName(v, "key", req.GetKey(), lim.MaxKeyBytes)
		if n := len(req.GetReason()); n > lim.MaxReasonBytes {
			v.addf("reason", "must be at most %d bytes, got %d", lim.MaxReasonBytes, n)
		}
		if req.GetKind() == idempotencyv1.FailureKind_FAILURE_KIND_REPLAYABLE && req.GetResponse() == nil {
			v.addf("response", "is required for FAILURE_KIND_REPLAYABLE")
		}
		checkResponse(v, "response", req.GetResponse(), lim)
	})
}

func (s *Server) validateLookup(req *idempotencyv1.LookupRequest, lim Limits) error {
	return validate(s.validator, req, func(v *violations) {
		checkName(v, "scope", req.GetScope(), lim.MaxScopeBytes)
		checkName(v, "key", req.GetKey(), lim.MaxKeyBytes)
	})
}

func (s *Server) validateHeartbeat(req *idempotencyv1.HeartbeatRequest, lim Limits) error {
	return validate(s.validator, req, func(v *violations) {
		checkName(v, "scope", req.GetScope(), lim.MaxScopeBytes)
		checkName(v, "key", req.GetKey(), lim.MaxKeyBytes)
		checkDuration(v, "lease", req.GetLease(), lim.MinLease, lim.MaxLease, false)
		if c := req.GetCheckpoint(); c != nil {
			// The phase's rules (1-128 printable bytes) are the proto's.
			if n := len(c.GetData()); n > lim.MaxCheckpointBytes {
				v.addf("checkpoint.data", "must be at most %d bytes (limits.max_checkpoint_bytes), got %d", lim.MaxCheckpointBytes, n)
			}
		}
	})
}
