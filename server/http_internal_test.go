package server

import (
	"net/http"
	"net/http/httptest"
	"testing"
)

// TestHostAllowed pins which Host headers the HTTP listener answers while
// auth is off.
func TestHostAllowed(t *testing.T) {
	allowed := map[string]bool{}
	WithHTTPAllowedHosts(" Coord.Example. ", "10.0.0.7:9090", "[fd00::7]", "")(&options{httpAllowedHosts: allowed})
	for host, want := range map[string]bool{
		"localhost": true, "LOCALHOST:9090": true, "localhost.": true, "localhost.:9090": true,
		"127.0.0.1": true, "127.0.0.1:9090": true, "127.1.2.3:1": true, "[::1]:9090": true, "[::1]": true,
		"::1": true, "[::ffff:127.0.0.1]:9090": true,
		"coord.example": true, "COORD.example:443": true, "10.0.0.7": true, "10.0.0.7:1": true, "[fd00::7]:9090": true,
		"": false, "evil.example": false, "evil.example:9090": false, "localhost.evil.example": false,
		"a.localhost": false, "127.0.0.1.evil.example": false, "0.0.0.0:9090": false, "[::]:9090": false,
		"10.0.0.8": false, "2130706433": false, "127.0.0.1:9090:1": false, "sub.coord.example": false,
	} {
		if got := hostAllowed(host, allowed); got != want {
			t.Errorf("hostAllowed(%q) = %v, want %v", host, got, want)
		}
	}
	if !hostAllowed("anything.example", map[string]bool{"*": true}) {
		t.Error(`"*" does not allow every host`)
	}
}

// TestRequestCompression pins which request encodings the HTTP listener
// takes: none, identity or gzip as Content-Encoding, nothing per message.
func TestRequestCompression(t *testing.T) {
	for _, tc := range []struct {
		url     string
		header  []string
		gz, err bool
	}{
		{url: "/m"},
		{url: "/m", header: []string{"Content-Encoding", "identity"}},
		{url: "/m", header: []string{"Content-Encoding", "GZIP"}, gz: true},
		{url: "/m", header: []string{"Content-Encoding", "identity, gzip"}, gz: true},
		{url: "/m", header: []string{"Content-Encoding", "x-gzip"}, gz: true},
		{url: "/m", header: []string{"Content-Encoding", "gzip, gzip"}, err: true},
		{url: "/m", header: []string{"Content-Encoding", "br"}, err: true},
		{url: "/m", header: []string{"Content-Encoding", "deflate"}, err: true},
		{url: "/m", header: []string{"Content-Encoding", "zstd"}, err: true},
		{url: "/m", header: []string{"Grpc-Encoding", "identity"}},
		{url: "/m", header: []string{"Grpc-Encoding", "gzip"}, err: true},
		{url: "/m", header: []string{"Connect-Content-Encoding", "gzip"}, err: true},
		{url: "/m?compression=identity"},
		{url: "/m?compression=gzip", err: true},
	} {
		r := httptest.NewRequest(http.MethodPost, tc.url, nil)
		for i := 0; i+1 < len(tc.header); i += 2 {
			r.Header.Add(tc.header[i], tc.header[i+1])
		}
		gz, err := requestCompression(r)
		if gz != tc.gz || (err != nil) != tc.err {
			t.Errorf("%s %v: gzip %v, err %v; want gzip %v, error %v", tc.url, tc.header, gz, err, tc.gz, tc.err)
		}
	}
}
