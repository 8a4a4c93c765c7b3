package console_test

import (
	"testing"

	"github.com/idemcoord/idemcoord/console"
)

// TestSafeNext: the page the sign-in form returns to is a console page of
// this server, never one outside /console/ (by dot segments, encoded or
// not, or backslashes) nor another site; a console page is kept as given.
func TestSafeNext(t *testing.T) {
	t.Parallel()
	for next, want := range map[string]string{
		"/console/":                                    "/console/",
		"/console/records?scope=build&key=k":           "/console/records?scope=build&key=k",
		"/console/records/build/a%2Fb":                 "/console/records/build/a%2Fb",
		"/console/../metrics":                          "/console/",
		"/console/../idempotency.v1.Admin/ListRecords": "/console/",
		"/console/..//evil.com":                        "/console/",
		"/console/../%5Cevil.com":                      "/console/",
		"/console/%2e%2e/metrics":                      "/console/",
		"/console/%2E%2E%2Fmetrics":                    "/console/",
		"/console/x/../../metrics":                     "/console/",
		"/console/./../metrics":                        "/console/",
		"/console/%5C%5Cevil.com":                      "/console/",
		"/console/\\evil.com":                          "/console/",
		"/console/login?next=/metrics":                 "/console/",
		"/console/x/../login":                          "/console/",
		"/console":                                     "/console/",
		"//evil.com/console/":                          "/console/",
		"https://evil.com/console/":                    "/console/",
		"/console/\r\nLocation: //evil.com":            "/console/",
		"":                                             "/console/",
	} {
		if got := console.SafeNext(next); got != want {
			t.Errorf("next %q: %q, want %q", next, got, want)
		}
	}
}
