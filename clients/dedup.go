package clients

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// DedupKey is the deterministic idempotency key for callers that send none:
// one key per user and intent on one project, so the retries of a user who
// double-clicks "create" share a record while two users never do.
//
// With a projectID it is "intent:userID:p:projectID". Without one it names
// the project by its name: "intent:userID:n:" followed by the first 16 hex
// digits of the SHA-256 of the normalized name, where normalizing trims the
// name, lower-cases it and folds every run of white space into one space,
// so " Flower  Shop " and "flower shop" give the same key. A projectID, when
// given, wins over the name.
//
// The parts are joined with ":" as they are; an intent or user id that
// contains ":" should be escaped by the caller if two of them could collide.
func DedupKey(intent, userID, projectID, projectName string) string {
	if projectID != "" {
		return intent + ":" + userID + ":p:" + projectID
	}
	sum := sha256.Sum256([]byte(NormalizeName(projectName)))
	return intent + ":" + userID + ":n:" + hex.EncodeToString(sum[:])[:16]
}

// NormalizeName is the normalization DedupKey applies to a project name:
// trimmed, lower-cased, every run of white space folded into one space. A
// fingerprint function that should treat the same names alike can apply it
// too.
func NormalizeName(name string) string {
	return strings.Join(strings.Fields(strings.ToLower(name)), " ")
}

// FoldPrincipal is the key the interceptor stores when WithPrincipal is
// set: the unpadded base64url SHA-256 of principal (43 characters), a colon,
// and key. Hashing keeps the key printable and bounded whatever the
// principal is, and keeps end-user ids out of the coordinator; use
// FoldPrincipal to find a user's record with Lookup or idemctl.
func FoldPrincipal(principal, key string) string {
	sum := sha256.Sum256([]byte(principal))
	return base64.RawURLEncoding.EncodeToString(sum[:]) + ":" + key
}

// Fingerprint is the interceptor's default request fingerprint: the SHA-256
// of the full method name, a newline, and the request's deterministic proto
// encoding.
func Fingerprint(fullMethod string, req proto.Message) ([]byte, error) {
	body, err := proto.MarshalOptions{Deterministic: true}.Marshal(req)
	if err != nil {
		return nil, err
	}
	h := sha256.New()
	h.Write([]byte(fullMethod))
	h.Write([]byte{'\n'})
	h.Write(body)
	return h.Sum(nil), nil
}

// KeyFromMetadata returns the idempotency key of an incoming call: the value
// of its "idempotency-key" metadata, "" when there is none. Two different
// values are an INVALID_ARGUMENT error.
func KeyFromMetadata(ctx context.Context) (string, error) {
	vals := metadata.ValueFromIncomingContext(ctx, MetadataKey)
	for _, v := range vals[min(len(vals), 1):] {
		if v != vals[0] {
			return "", status.Error(codes.InvalidArgument, "more than one idempotency-key")
		}
	}
	if len(vals) == 0 {
		return "", nil
	}
	return vals[0], nil
}

func keyFromMetadata(ctx context.Context, _ any) (string, error) { return KeyFromMetadata(ctx) }
