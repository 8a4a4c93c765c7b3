//go:build tools

// Package tools pins helm, which `make deploy-check` builds into ./bin from
// this module so that helm's dependencies stay out of the main go.mod.
package tools

import _ "helm.sh/helm/v3/cmd/helm"
