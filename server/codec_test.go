package server_test

import (
	"context"
	"testing"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
)

// rawCodec sends and receives undecoded bytes, to put on the wire what no
// well-behaved client library would.
type rawCodec struct{}

func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	return mem.BufferSlice{mem.SliceBuffer(*v.(*[]byte))}, nil
}

func (rawCodec) Unmarshal(data mem.BufferSlice, v any) error {
	*v.(*[]byte) = data.Materialize()
	return nil
}

func (rawCodec) Name() string { return "proto" }

// TestInvalidUTF8IsInvalidArgument sends string fields that are not UTF-8
// (grpc itself would answer INTERNAL): the answer is INVALID_ARGUMENT naming
// the field, and nothing is written.
func TestInvalidUTF8IsInvalidArgument(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envOptions{})
	str := func(b []byte, num protowire.Number, s string) []byte {
		b = protowire.AppendTag(b, num, protowire.BytesType)
		return protowire.AppendString(b, s)
	}
	cases := []struct {
		method, field string
		msg           []byte
	}{
		{"Begin", "key", str(str(nil, 1, "s"), 2, "k\xff\xfe")},
		{"Begin", "scope", str(str(nil, 1, "\xc3\x28"), 2, "k")},
		{"Begin", "attempt_id", str(str(str(nil, 1, "s"), 2, "k"), 8, "\x80")},
		{"Lookup", "key", str(str(nil, 1, "s"), 2, "\xed\xa0\x80")},
		{"Complete", "response.metadata.value", func() []byte {
			entry := str(str(nil, 1, "k"), 2, "v\xff")
			resp := protowire.AppendTag(nil, 5, protowire.BytesType)
			resp = protowire.AppendBytes(resp, entry)
			b := str(str(str(nil, 1, "s"), 2, "k"), 3, "tok")
			b = protowire.AppendTag(b, 4, protowire.BytesType)
			return protowire.AppendBytes(b, resp)
		}()},
	}
	for _, c := range cases {
		var out []byte
		err := e.coord.Dial(t).Invoke(context.Background(), "/idempotency.v1.Coordinator/"+c.method, &c.msg, &out,
			grpc.ForceCodecV2(rawCodec{}))
		st := wantCode(t, err, codes.InvalidArgument, "")
		found := false
		for _, d := range st.Details() {
			if br, ok := d.(*errdetails.BadRequest); ok {
				for _, v := range br.GetFieldViolations() {
					found = found || (v.GetField() == c.field && v.GetDescription() == "must be valid UTF-8")
				}
			}
		}
		if !found {
			t.Errorf("%s: %v does not name %s as invalid UTF-8", c.method, st.Details(), c.field)
		}
	}
	// Garbage that is not a message at all is still refused, not a panic.
	junk := []byte{0xff, 0xff, 0xff}
	var out []byte
	err := e.coord.Dial(t).Invoke(context.Background(), "/idempotency.v1.Coordinator/Begin", &junk, &out, grpc.ForceCodecV2(rawCodec{}))
	wantCode(t, err, codes.InvalidArgument, "")
	if n := e.rowCount(); n != 0 {
		t.Fatalf("%d rows written", n)
	}
}
