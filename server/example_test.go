package server_test

import (
	"fmt"

	"github.com/idemcoord/idemcoord/server"
)

// A certificate authenticates a tenant only through that tenant's
// client_cert_names; a configuration in which one certificate name (or one
// token hash) would select two tenants is refused.
func ExampleParsePolicies_clientCertNames() {
	ok := `tenants:
  - { name: ci, client_cert_names: ["spiffe://example.org/ci"], scopes: [build] }
`
	p, err := server.ParsePolicies([]byte(ok))
	fmt.Println(p.AuthEnabled(), err)

	clash := `tenants:
  - { name: ci, client_cert_names: [runner], scopes: [build] }
  - { name: ops, client_cert_names: [runner], scopes: ["*"], admin: true }
`
	_, err = server.ParsePolicies([]byte(clash))
	fmt.Println(err)
	// Output:
	// true <nil>
	// tenants[1]: tenant "ops": client certificate name "runner" is listed twice (also by tenants[0])
}
