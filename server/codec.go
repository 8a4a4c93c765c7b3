package server

import (
	"fmt"
	"strings"
	"unicode/utf8"

	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// invalidUTF8Field is the unknown field number on which the codec records,
// for validation, the paths of string fields that arrived as invalid UTF-8.
const invalidUTF8Field protowire.Number = protowire.MaxValidNumber

// malformedMessage is the path recorded for a request that is not
// well-formed protobuf wire data.
const malformedMessage = ""

// lenientCodec is the server's proto codec. It behaves like grpc's own,
// except that a request whose only fault is invalid UTF-8 in string fields
// is decoded anyway (the bad bytes replaced) and marked, so validation
// answers INVALID_ARGUMENT naming the fields, and a request that is not
// protobuf at all is decoded as empty and marked likewise; grpc would
// otherwise answer INTERNAL for what is a client mistake.
type lenientCodec struct {
	encoding.CodecV2
}

func newLenientCodec() lenientCodec {
	return lenientCodec{CodecV2: encoding.GetCodecV2("proto")}
}

// Unmarshal decodes data into v.
func (c lenientCodec) Unmarshal(data mem.BufferSlice, v any) error {
	err := c.CodecV2.Unmarshal(data, v)
	if err == nil {
		return nil
	}
	m, ok := v.(proto.Message)
	if !ok {
		return err
	}
	fixed, bad := sanitizeUTF8(data.Materialize(), m.ProtoReflect().Descriptor(), "")
	if len(bad) == 0 || proto.Unmarshal(fixed, m) != nil {
		// Not a well-formed message at all: decode it as empty and mark it,
		// so validation refuses it as INVALID_ARGUMENT too.
		proto.Reset(m)
		bad = []string{malformedMessage}
	}
	var mark []byte
	for _, path := range bad {
		mark = protowire.AppendTag(mark, invalidUTF8Field, protowire.BytesType)
		mark = protowire.AppendString(mark, path)
	}
	r := m.ProtoReflect()
	r.SetUnknown(append(r.GetUnknown(), mark...))
	return nil
}

// sanitizeUTF8 rewrites b, a message of type md, replacing invalid UTF-8 in
// string fields (nested messages and map entries included) and returning
// the paths of the fields it fixed (an element of a repeated field with its
// index: calls[3].lookup.key). It returns b unchanged when b is not
// well-formed wire data.
func sanitizeUTF8(b []byte, md protoreflect.MessageDescriptor, prefix string) ([]byte, []string) {
	var out []byte
	var bad []string
	var seen map[protowire.Number]int // elements of repeated fields so far
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return b, nil
		}
		m := protowire.ConsumeFieldValue(num, typ, b[n:])
		if m < 0 {
			return b, nil
		}
		field := b[:n+m]
		b = b[n+m:]
		fd := md.Fields().ByNumber(num)
		if typ != protowire.BytesType || fd == nil {
			out = append(out, field...)
			continue
		}
		val, _ := protowire.ConsumeBytes(field[n:])
		path := prefix + string(fd.Name())
		if fd.IsList() {
			// The i-th element of a repeated field, as calls[3].
			if seen == nil {
				seen = map[protowire.Number]int{}
			}
			path = fmt.Sprintf("%s[%d]", path, seen[num])
			seen[num]++
		}
		switch {
		case fd.Kind() == protoreflect.StringKind && !utf8.Valid(val):
			bad = append(bad, path)
			val = []byte(strings.ToValidUTF8(string(val), "\uFFFD"))
		case fd.Kind() == protoreflect.MessageKind:
			var sub []string
			val, sub = sanitizeUTF8(val, fd.Message(), path+".")
			bad = append(bad, sub...)
		}
		out = protowire.AppendTag(out, num, typ)
		out = protowire.AppendBytes(out, val)
	}
	return out, bad
}

// invalidUTF8Paths returns the fields the codec marked as invalid UTF-8.
func invalidUTF8Paths(m proto.Message) []string {
	var paths []string
	b := m.ProtoReflect().GetUnknown()
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			break
		}
		m := protowire.ConsumeFieldValue(num, typ, b[n:])
		if m < 0 {
			break
		}
		if num == invalidUTF8Field && typ == protowire.BytesType {
			v, _ := protowire.ConsumeBytes(b[n:])
			paths = append(paths, string(v))
		}
		b = b[n+m:]
	}
	return paths
}
