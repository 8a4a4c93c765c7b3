package server

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"time"
	"unicode/utf8"

	"google.golang.org/protobuf/types/known/timestamppb"

	idempotencyv1 "github.com/idemcoord/idemcoord/gen/idempotency/v1"
	"github.com/idemcoord/idemcoord/ledger"
	"github.com/idemcoord/idemcoord/statemachine"
)

// defaultPageSize is the page size of a ListRecords call that sets none; the
// proto caps page_size at 1000.
const defaultPageSize = 100

// adminService is the idempotency.v1.Admin service of a Server. Its calls
// act within the caller's tenant and, when auth is on, only admin tenants
// may make them (PERMISSION_DENIED otherwise). The policy of a scope does
// not apply to an operator's Resolve or Forget.
type adminService struct {
	idempotencyv1.UnimplementedAdminServer
	s *Server
}

// ListRecords pages through the tenant's records; see idempotency.v1.Admin.
func (a *adminService) ListRecords(ctx context.Context, req *idempotencyv1.ListRecordsRequest) (*idempotencyv1.ListRecordsResponse, error) {
	if err := authorizeAdmin(ctx); err != nil {
		return nil, err
	}
	var after *ledger.RecordKey
	err := validate(a.s.validator, req, func(v *violations) {
		checkName(v, "scope_glob", req.GetScopeGlob(), maxScopeGlobBytes)
		checkName(v, "key_prefix", req.GetKeyPrefix(), maxKeyPrefixBytes)
		if req.GetUncertain() {
			switch req.GetState() {
			case idempotencyv1.State_STATE_UNSPECIFIED, idempotencyv1.State_STATE_UNKNOWN, idempotencyv1.State_STATE_FAILED_RETRYABLE:
			default:
				v.addf("state", "with uncertain, only STATE_UNKNOWN or STATE_FAILED_RETRYABLE (or none): no other state needs a decision")
			}
			if req.GetArchived() {
				v.addf("uncertain", "not with archived: archived records take no decision (the key is new again)")
			}
		}
		if req.GetPageToken() == "" {
			return
		}
		var ok bool
		if after, ok = decodePageToken(req); !ok {
			v.addf("page_token", "not a next_page_token of a ListRecords call with these filters")
		}
	})
	if err != nil {
		return nil, a.s.status(ctx, err)
	}
	size := int(req.GetPageSize())
	if size == 0 {
		size = defaultPageSize
	}
	tenant := tenantFrom(ctx)
	res, err := a.s.store.ListRecords(ctx, &ledger.ListParams{Tenant: tenant,
		State: statemachine.State(req.GetState()), NeedsDecision: req.GetUncertain(), ScopeGlob: req.GetScopeGlob(), //nolint:gosec // protovalidate (enum.defined_only) admits only the State values, all below 256
		KeyPrefix: req.GetKeyPrefix(), CheckpointPhase: req.GetCheckpointPhase(), After: after, Limit: size, Archived: req.GetArchived()})
	if err != nil {
		return nil, a.s.status(ctx, err)
	}
	noteCall(ctx, tenant, "", "")
	out := &idempotencyv1.ListRecordsResponse{Records: make([]*idempotencyv1.Record, 0, len(res.Records))}
	for _, r := range res.Records {
		rec := recordToProto(r.Scope, r.Key, r.Record)
		if req.GetArchived() {
			rec.ArchivedAt = timestamppb.New(r.ArchivedAt)
		}
		out.Records = append(out.Records, rec)
	}
	if res.More {
		out.NextPageToken = encodePageToken(req, res.Records[len(res.Records)-1].RecordKey)
	}
	return out, nil
}

// Resolve ends an UNKNOWN record as an operator decided; see
// idempotency.v1.Admin.
func (a *adminService) Resolve(ctx context.Context, req *idempotencyv1.ResolveRequest) (*idempotencyv1.ResolveResponse, error) {
	if err := authorizeAdmin(ctx); err != nil {
		return nil, err
	}
	lim := a.s.policies.Load().Limits()
	err := validate(a.s.validator, req, func(v *violations) {
		checkIdentity(v, req.GetScope(), req.GetKey(), lim)
		if req.GetResolution() == idempotencyv1.Resolution_RESOLUTION_RETRYABLE && req.GetResponse() != nil {
			v.addf("response", "must be absent for RESOLUTION_RETRYABLE: a retryable record stores no response")
		}
		checkResponse(v, "response", req.GetResponse(), lim)
	})
	if err != nil {
		return nil, a.s.status(ctx, err)
	}
	as := statemachine.StateCompleted
	if req.GetResolution() == idempotencyv1.Resolution_RESOLUTION_RETRYABLE {
		as = statemachine.StateFailedRetryable
	}
	id := identity(ctx, req.GetScope(), req.GetKey())
	res, err := a.s.store.Resolve(ctx, &ledger.ResolveParams{ID: id, As: as, Response: responseFromProto(req.GetResponse())})
	a.s.metrics.observeFinish(req.GetScope(), res, err) // a lapsed lease enters UNKNOWN here
	if err != nil {
		return nil, a.s.status(ctx, err)
	}
	noteCall(ctx, id.Tenant, id.Scope, "")
	return &idempotencyv1.ResolveResponse{Record: recordToProto(req.GetScope(), req.GetKey(), res.Record)}, nil
}

// Forget deletes a record whatever its state; see idempotency.v1.Admin.
func (a *adminService) Forget(ctx context.Context, req *idempotencyv1.ForgetRequest) (*idempotencyv1.ForgetResponse, error) {
	if err := authorizeAdmin(ctx); err != nil {
		return nil, err
	}
	lim := a.s.policies.Load().Limits()
	err := validate(a.s.validator, req, func(v *violations) {
		checkIdentity(v, req.GetScope(), req.GetKey(), lim)
	})
	if err != nil {
		return nil, a.s.status(ctx, err)
	}
	id := identity(ctx, req.GetScope(), req.GetKey())
	rec, err := a.s.store.Forget(ctx, &ledger.ForgetParams{ID: id})
	if err != nil {
		return nil, a.s.status(ctx, err)
	}
	noteCall(ctx, id.Tenant, id.Scope, "")
	return &idempotencyv1.ForgetResponse{Record: recordToProto(req.GetScope(), req.GetKey(), rec)}, nil
}

// GetRecord reads one record with its response; see idempotency.v1.Admin.
func (a *adminService) GetRecord(ctx context.Context, req *idempotencyv1.GetRecordRequest) (*idempotencyv1.GetRecordResponse, error) {
	if err := authorizeAdmin(ctx); err != nil {
		return nil, err
	}
	lim := a.s.policies.Load().Limits()
	err := validate(a.s.validator, req, func(v *violations) {
		checkIdentity(v, req.GetScope(), req.GetKey(), lim)
	})
	if err != nil {
		return nil, a.s.status(ctx, err)
	}
	id := identity(ctx, req.GetScope(), req.GetKey())
	rec, _, err := a.s.store.Lookup(ctx, id)
	if err != nil {
		return nil, a.s.status(ctx, err)
	}
	noteCall(ctx, id.Tenant, id.Scope, "")
	return &idempotencyv1.GetRecordResponse{Record: recordToProto(req.GetScope(), req.GetKey(), rec)}, nil
}

// maxCountGroups is the most groups a CountRecords call returns, and what
// max_groups 0 means.
const maxCountGroups = 1000

// CountRecords counts the tenant's records by scope and state; see
// idempotency.v1.Admin.
func (a *adminService) CountRecords(ctx context.Context, req *idempotencyv1.CountRecordsRequest) (*idempotencyv1.CountRecordsResponse, error) {
	if err := authorizeAdmin(ctx); err != nil {
		return nil, err
	}
	if err := validate(a.s.validator, req, func(*violations) {}); err != nil {
		return nil, a.s.status(ctx, err)
	}
	limit := int(req.GetMaxGroups())
	if limit == 0 {
		limit = maxCountGroups
	}
	tenant := tenantFrom(ctx)
	res, err := a.s.store.CountRecords(ctx, &ledger.CountParams{Tenant: tenant, MaxGroups: limit})
	if err != nil {
		return nil, a.s.status(ctx, err)
	}
	noteCall(ctx, tenant, "", "")
	out := &idempotencyv1.CountRecordsResponse{Truncated: res.Truncated,
		Counts: make([]*idempotencyv1.RecordCount, 0, len(res.Counts))}
	for _, c := range res.Counts {
		out.Counts = append(out.Counts, &idempotencyv1.RecordCount{Scope: c.Scope,
			State: idempotencyv1.State(c.State), Count: c.Count})
	}
	return out, nil
}

// checkIdentity checks a request's scope and key against the limits.
func checkIdentity(v *violations, scope, key string, lim Limits) {
	checkName(v, "scope", scope, lim.MaxScopeBytes)
	checkName(v, "key", key, lim.MaxKeyBytes)
}

// maxScopeGlobBytes bounds ListRecordsRequest.scope_glob (the proto says
// the same; checkName also wants valid UTF-8).
const maxScopeGlobBytes = 1024

// maxKeyPrefixBytes bounds ListRecordsRequest.key_prefix, as the proto
// does.
const maxKeyPrefixBytes = 255

// Page tokens are opaque to callers: base64url of a version byte, the first
// 8 bytes of a hash of the request's filters (so a token is refused with
// other filters), for the archive the archived_at of the page's last record
// (8 bytes, µs since the Unix epoch), and the (scope, key) of the page's
// last record, the scope prefixed by its length as a uvarint.
const pageTokenVersion = 1

func filterHash(req *idempotencyv1.ListRecordsRequest) []byte {
	h := sha256.New()
	_ = binary.Write(h, binary.BigEndian, int32(req.GetState()))
	h.Write([]byte(req.GetScopeGlob()))
	if p := req.GetKeyPrefix(); p != "" {
		// A printable glob holds no NUL, so the two stay apart; tokens
		// without a prefix keep the hash they had before key_prefix.
		h.Write([]byte{0})
		h.Write([]byte(p))
	}
	if req.GetArchived() {
		h.Write([]byte{1})
	}
	if req.GetUncertain() {
		h.Write([]byte{2})
	}
	if p := req.GetCheckpointPhase(); p != "" {
		h.Write([]byte{3})
		h.Write([]byte(p))
	}
	return h.Sum(nil)[:8]
}

func encodePageToken(req *idempotencyv1.ListRecordsRequest, last ledger.RecordKey) string {
	b := append([]byte{pageTokenVersion}, filterHash(req)...)
	if req.GetArchived() {
		b = binary.BigEndian.AppendUint64(b, uint64(last.ArchivedAt.UnixMicro()))
	}
	b = binary.AppendUvarint(b, uint64(len(last.Scope)))
	b = append(b, last.Scope...)
	b = append(b, last.Key...)
	return base64.RawURLEncoding.EncodeToString(b)
}

// decodePageToken returns the record a page token continues after, or false
// when the token is not one encodePageToken made for these filters.
func decodePageToken(req *idempotencyv1.ListRecordsRequest) (*ledger.RecordKey, bool) {
	b, err := base64.RawURLEncoding.DecodeString(req.GetPageToken())
	if err != nil || len(b) < 9 || b[0] != pageTokenVersion || !bytes.Equal(b[1:9], filterHash(req)) {
		return nil, false
	}
	b = b[9:]
	var archivedAt time.Time
	if req.GetArchived() {
		if len(b) < 8 {
			return nil, false
		}
		archivedAt = time.UnixMicro(int64(binary.BigEndian.Uint64(b))).UTC() //nolint:gosec // the cursor's bit pattern of the UnixMicro this server encoded
		b = b[8:]
	}
	n, w := binary.Uvarint(b)
	if w <= 0 || n > uint64(len(b)-w) { //nolint:gosec // w > 0 here and w <= len(b), so len(b)-w is not negative
		return nil, false
	}
	k := &ledger.RecordKey{Scope: string(b[w : w+int(n)]), Key: string(b[w+int(n):]), ArchivedAt: archivedAt} //nolint:gosec // n <= len(b)-w, checked above
	// The names go into SQL as text: they must be names a record can have.
	if !printableName(k.Scope) || !printableName(k.Key) {
		return nil, false
	}
	return k, true
}

// printableName reports whether s is valid UTF-8 without control characters
// (Unicode Cc), as every stored scope and key is.
func printableName(s string) bool {
	if !utf8.ValidString(s) {
		return false
	}
	for _, r := range s {
		if r < 0x20 || r >= 0x7f && r < 0xa0 {
			return false
		}
	}
	return true
}
