// Command fakeupstreams serves fake charge, provision and receipt upstreams
// for the provisioning demo (provisioning.NewUpstreams) on -listen: each
// POST /{step}?order=O acts again, as a card network does when called twice.
package main

import (
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/idemcoord/idemcoord/examples/provisioning"
)

func main() {
	listen := flag.String("listen", "127.0.0.1:8081", "HTTP listen address")
	flag.Parse()
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		fmt.Fprintln(os.Stderr, "fakeupstreams:", err)
		os.Exit(1)
	}
	fmt.Println("listening on", ln.Addr())
	srv := &http.Server{Handler: provisioning.NewUpstreams(), ReadHeaderTimeout: 10 * time.Second}
	fmt.Fprintln(os.Stderr, "fakeupstreams:", srv.Serve(ln))
	os.Exit(1)
}
