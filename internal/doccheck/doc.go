// Package doccheck holds `make check-docs`: tests that keep README.md and
// docs/ true to the code. Every fenced code block names its language and is
// compiled or checked by it (Go as a complete program, shell with bash -n,
// YAML as a coordinator config, JavaScript with node --check, Python with
// compile), every Go block that reads IDEMCOORD_TOKEN runs against a real
// coordinator with auth on (refused without the token, working with it),
// as do the Node and Python pages' programs (node, /usr/bin/python3); the
// HTTP page's middleware program serves every client the pages show for it;
// the operating page's config runs a coordinator on which its idemctl
// session is run; the Go page's install lines set up a module outside the
// repository that builds its program; every stated default of a flag is the
// binary's; `make help` lists every target of the Makefile truly and every
// `make TARGET` of the docs exists;
// every block marked as generated equals its command's output,
// every relative link and #anchor resolves, and no page cites an issue
// number. The package has no code of its own; nothing imports it.
package doccheck
