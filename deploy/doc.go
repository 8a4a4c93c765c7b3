// Package deploy holds the deployment files of idemcoord — the image's
// Containerfile, the Helm chart, the Prometheus alerts, the Grafana
// dashboard and the systemd unit — and the tests that check them against
// the binary: its flags, its metrics, the built image.
//
// It has no code of its own, and its tests import only the standard library
// and the YAML parser of go.mod: they run the tools (buildah, helm,
// promtool, the idemcoord binary) as programs.
package deploy
