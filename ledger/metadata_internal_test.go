package ledger

import (
	"encoding/json"
	"maps"
	"strings"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
)

// TestMetadataStoredForm round-trips metadata through its stored form,
// reads the JSON of older rows, refuses a truncated value, and checks that
// the stored form is never larger than the protobuf encoding of the same
// map (which the response limit counts), whatever the characters.
func TestMetadataStoredForm(t *testing.T) {
	for _, m := range []map[string]string{
		{"a": "b"},
		{"html": "<script>&amp;</script>", "ctl": "\x00\x01\x1f\u2028", "": ""},
		{"big": strings.Repeat("<", 70000), strings.Repeat("k", 200): "v"},
	} {
		got, err := decodeMetadata(encodeMetadata(m))
		if err != nil || !maps.Equal(got, m) {
			t.Errorf("round trip of %.40q: %.40q %v", m, got, err)
		}
		legacy, _ := json.Marshal(m)
		if got, err := decodeMetadata(legacy); err != nil || !maps.Equal(got, m) {
			t.Errorf("JSON of %.40q: %.40q %v", m, got, err)
		}
		// The protobuf size of map<string,string> field 5: one entry
		// message per pair.
		var pb []byte
		for k, v := range m {
			var entry []byte
			entry = protowire.AppendTag(entry, 1, protowire.BytesType)
			entry = protowire.AppendString(entry, k)
			entry = protowire.AppendTag(entry, 2, protowire.BytesType)
			entry = protowire.AppendString(entry, v)
			pb = protowire.AppendTag(pb, 5, protowire.BytesType)
			pb = protowire.AppendBytes(pb, entry)
		}
		if stored := len(encodeMetadata(m)); stored > len(pb) {
			t.Errorf("stored form of %.40q: %d bytes, more than its protobuf encoding (%d)", m, stored, len(pb))
		}
	}
	enc := encodeMetadata(map[string]string{"key": "value"})
	for i := 2; i < len(enc); i++ { // the format byte alone is an empty map
		if _, err := decodeMetadata(enc[:i]); err == nil {
			t.Errorf("truncated to %d bytes: no error", i)
		}
	}
}
