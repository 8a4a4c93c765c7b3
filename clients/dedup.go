package clients

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"strings"
	"unicode"

	"golang.org/x/text/cases"
	"golang.org/x/text/language"
	"golang.org/x/text/unicode/norm"
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
// the project by its name: "intent:userID:n:" followed by the first 16
// lower-case hex digits of the SHA-256 of the UTF-8 of NormalizeName(name),
// so " Flower  Shop " and "flower shop" give the same key. A projectID,
// when given, wins over the name. intent, userID and projectID are used as
// they are; an intent or user id that contains ":" should be escaped by the
// caller if two of them could collide.
//
// The Node (dedupKey in clients/node) and Python (idemcoord.dedup_key in
// clients/python) libraries implement the same specification and pass the
// same vectors (clients/testdata/dedupkey.json), so a Node front end and a
// Go back end derive one key for one project.
func DedupKey(intent, userID, projectID, projectName string) string {
	if projectID != "" {
		return intent + ":" + userID + ":p:" + projectID
	}
	sum := sha256.Sum256([]byte(NormalizeName(projectName)))
	return intent + ":" + userID + ":n:" + hex.EncodeToString(sum[:])[:16]
}

// NormalizeName is the normalization DedupKey applies to a project name, in
// this order:
//
//  1. Unicode NFC (canonical composition);
//  2. every U+FEFF (zero width no-break space, the byte-order mark) removed;
//  3. leading and trailing Unicode White_Space trimmed (this includes
//     U+0085, U+00A0, U+2028 and U+3000; it excludes U+200B and U+FEFF);
//  4. the full Unicode lower-case mapping of the root locale: SpecialCasing
//     included, so "İ" (U+0130) becomes "i̇" (U+0069 U+0307) and a
//     word-final "Σ" becomes "ς" (Final_Sigma), as JavaScript's
//     toLowerCase and Python's str.lower do; no Turkish or Lithuanian rules;
//  5. every run of White_Space folded into one space (U+0020).
//
// Invalid UTF-8 is first replaced by U+FFFD, one per run of bad bytes
// (Node and Python replace each lone surrogate the same way). The
// implementations agree on every character assigned in Unicode 14.0 (the
// oldest of the three runtimes' tables: Python 3.11); Go's tables are
// golang.org/x/text's.
//
// A fingerprint function that should treat the same names alike can apply
// it too.
func NormalizeName(name string) string {
	s := norm.NFC.String(strings.ToValidUTF8(name, "\uFFFD"))
	s = strings.ReplaceAll(s, "\uFEFF", "")
	// Lower-casing neither makes nor removes White_Space, so splitting
	// afterwards does steps 3 and 5 at once. A Caser is not safe for
	// concurrent use: one per call.
	s = cases.Lower(language.Und).String(s)
	return strings.Join(strings.FieldsFunc(s, isWhiteSpace), " ")
}

// isWhiteSpace reports whether r has the Unicode White_Space property.
func isWhiteSpace(r rune) bool { return unicode.Is(unicode.White_Space, r) }

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
