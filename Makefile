# Tool versions are pinned; `make tools` installs them into ./bin.
BUF_VERSION                := v1.57.0
PROTOC_GEN_GO_VERSION      := v1.36.12
PROTOC_GEN_GO_GRPC_VERSION := v1.5.1
GRPCURL_VERSION            := v1.9.3
GHZ_VERSION                := v0.121.0
TOXIPROXY_VERSION          := v2.5.0
GOLANGCI_LINT_VERSION      := v2.15.0
# helm is built from tools/helm, a module of its own (its dependencies stay out of go.mod);
# HELM_VERSION must be the version tools/helm/go.mod requires.
HELM_VERSION               := v3.19.0

BIN    := $(CURDIR)/bin
export PATH := $(BIN):$(PATH)
export GOTOOLCHAIN := local

GO_PACKAGES := ./...

## all: the default target: `make test`
.PHONY: all help run test lint generate check-generated tools build bench clean-data

all: test

## help: list the targets and what each does (these `## target:` comments)
help:
	@awk '/^## [A-Za-z0-9_-]+:/ { line = substr($$0, 4); name = line; sub(/:.*/, "", name); sub(/^[^:]*: */, "", line); \
	    printf "  %-22s %s\n", name, line; next } \
	  /^## / { printf "  %-22s %s\n", "", substr($$0, 4) }' $(MAKEFILE_LIST)

## run: start the coordinator on 127.0.0.1:50051 (with a local PostgreSQL under .data/ unless DATABASE_URL is set)
run: build
	@scripts/run-local.sh

## test-citus: the ledger's and the server's tests against a local Citus cluster (a coordinator node and two
## workers that internal/pgtest starts; Citus from ../shared/citus/build.sh), then the Citus fault tests of
## chaos/ (a worker killed under load; the reference model, short), as .ci/run runs them
.PHONY: test-citus
test-citus:
	IDEMCOORD_TEST_CITUS=1 go test -count=1 -timeout 25m ./ledger/ ./server/
	IDEMCOORD_TEST_CITUS=1 go test -count=1 -timeout 15m -v -run '^TestCitus' ./chaos/

## test-pgbouncer: every server behaviour test with the coordinator behind a PgBouncer in transaction
## pooling mode, LISTEN direct and notifications off (`make test` runs a representative set)
.PHONY: test-pgbouncer
test-pgbouncer:
	IDEMCOORD_TEST_PGBOUNCER=listen go test -race -count=1 ./server/
	IDEMCOORD_TEST_PGBOUNCER=poll go test -race -count=1 ./server/

## run-ha: the coordinator on a local pg_auto_failover cluster under .data-ha/ (monitor + three nodes,
## number_sync_standbys = 1) via its multi-host URL; `scripts/run-ha.sh failover` in another terminal fails over
.PHONY: run-ha
run-ha: build
	@scripts/run-ha.sh

## run-citus: the coordinator on a local Citus cluster under .data/citus/ (a coordinator node and two workers, durable,
## kept between runs; needs the citus extension: ../shared/citus/build.sh); see docs/scale-out.md
.PHONY: run-citus
run-citus: build
	@scripts/run-citus.sh

## build: compile the coordinator into ./bin/idemcoord (idemctl: `go build -o bin/idemctl ./cmd/idemctl`)
build:
	go build -o $(BIN)/idemcoord ./cmd/idemcoord

## test: lint, check generated code, check the docs, run every test with the race detector, and the Go client's
## tests and the Node and Python clients' suites a second time with their calls sharing Batch RPCs
## (clients.WithCallBatching, callBatching, call_batching); tests' artifacts (the console's browser screenshot)
## land under .artifacts/_artifacts/
ARTIFACTS := $(CURDIR)/.artifacts
test: lint check-docs deploy-check
	@mkdir -p $(ARTIFACTS)
	go test -race -count=1 -artifacts -outputdir $(ARTIFACTS) $(GO_PACKAGES)
	IDEMCOORD_TEST_CALL_BATCHING=2 go test -race -count=1 ./clients/
	IDEMCOORD_TEST_CALL_BATCHING=2 go test -count=1 -run '^Test(Node|Python)Client$$' ./clients/polyglot/

## check-docs: compile or check every code block of README.md and docs/ (Go built as programs, sh with bash -n,
## yaml as a config, js and python parsed), run the pages' Go, Node, Python and HTTP programs against a coordinator
## and the operating page's config and idemctl session, check stated flag defaults and make help against the code,
## compare generated blocks with their commands, resolve every relative link and #anchor
.PHONY: check-docs docs-generated
check-docs:
	go test -count=1 ./internal/doccheck/

## docs-generated: rewrite the docs' generated blocks (the Performance figures, from bench/results) from their commands
docs-generated:
	go test -count=1 -run '^TestGeneratedBlocksAreCurrent$$' ./internal/doccheck/ -update

## chaos: the long fault tests (IDEMCOORD_CHAOS=long; the short ones run in `make test`): coordinator
## SIGKILL, PostgreSQL stop/kill, connection cuts, linearizability, the payments demo (RunTx) and the provisioning demo (checkpoints) under SIGKILL, the demo services
## driven by third-party retrying clients through toxiproxy (TestRetryingClients); each prints a `chaos: <test>:` line
.PHONY: chaos fuzz-short
chaos:
	IDEMCOORD_CHAOS=long go test -race -count=1 -timeout 30m -v ./chaos/ ./examples/payments/ ./examples/provisioning/

## mutants: plant each bug of a fixed list (scripts/mutants.sh) in a throwaway copy, one at a
## time, and check that the tests named for it fail; prints the score
## gremlins-statemachine: the gremlins mutation tool (pinned) over statemachine
.PHONY: mutants gremlins-statemachine
GREMLINS_VERSION := v0.6.0
mutants:
	scripts/mutants.sh
gremlins-statemachine: $(BIN)/.gremlins-$(GREMLINS_VERSION)
	$(BIN)/gremlins unleash --workers 1 --test-cpu 1 --threshold-efficacy 100 ./statemachine
$(BIN)/.gremlins-$(GREMLINS_VERSION):
	GOBIN=$(BIN) go install github.com/go-gremlins/gremlins/cmd/gremlins@$(GREMLINS_VERSION)
	@touch $@

## fuzz-short: run every fuzz target for a fixed number of executions, as CI does: the state
## machine FUZZ_FAST times, the config and header parsers FUZZ_PARSE times, a target that goes
## through the server and PostgreSQL FUZZ_DB times (each 5-10 s on the 2-core machine). Counts, not durations: with a duration, Go 1.26's fuzz
## coordinator can fail a clean run with "context deadline exceeded" at the deadline
## (golang/go#75804, fixed in Go 1.27). A new input is minimized for at most 200 executions.
FUZZ_FAST ?= 300000x
FUZZ_PARSE ?= 40000x
FUZZ_DB   ?= 4000x
FUZZFLAGS := -run '^$$' -fuzzminimizetime 200x
fuzz-short:
	go test ./statemachine $(FUZZFLAGS) -fuzztime $(FUZZ_FAST) -fuzz '^FuzzNext$$'
	go test ./server $(FUZZFLAGS) -fuzztime $(FUZZ_DB) -fuzz '^FuzzBegin$$'
	go test ./server $(FUZZFLAGS) -fuzztime $(FUZZ_DB) -fuzz '^FuzzComplete$$'
	go test ./server $(FUZZFLAGS) -fuzztime $(FUZZ_DB) -fuzz '^FuzzFail$$'
	go test ./server $(FUZZFLAGS) -fuzztime $(FUZZ_DB) -fuzz '^FuzzBatch$$'
	go test ./server $(FUZZFLAGS) -fuzztime $(FUZZ_PARSE) -fuzz '^FuzzParsePolicies$$'
	go test ./server $(FUZZFLAGS) -fuzztime $(FUZZ_DB) -fuzz '^FuzzAuthenticate$$'
	go test ./clients $(FUZZFLAGS) -fuzztime $(FUZZ_PARSE) -fuzz '^FuzzParseIdempotencyKey$$'

## image: build the OCI image idemcoord:$(VERSION) with buildah, from scratch (static binary, UID 65532,
## CA certificates, OCI labels; no registry needed), then inspect it (deploy/image_test.go)
VERSION       ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
COMMIT        ?= $(shell git rev-parse HEAD 2>/dev/null || echo unknown)
BUILDAH_FLAGS ?= --storage-driver vfs
export BUILDAH_FLAGS
.PHONY: image
image:
	VERSION=$(VERSION) COMMIT=$(COMMIT) scripts/build-image.sh
	IDEMCOORD_IMAGE=idemcoord:$(VERSION) IDEMCOORD_IMAGE_VERSION=$(VERSION) IDEMCOORD_IMAGE_COMMIT=$(COMMIT) \
	  go test -count=1 -run '^TestImage$$' ./deploy/

## deploy-check: lint the Helm chart with the pinned helm (every value set of deploy/testdata/helm), then
## render it and check it against the binary's flags, run promtool on the alerts and their tests, and check
## that alerts and dashboard name only exported metrics (go test ./deploy/)
.PHONY: deploy-check
deploy-check: $(BIN)/.helm-$(HELM_VERSION) build
	@command -v promtool >/dev/null || { echo "deploy-check: no promtool (Debian: apt-get install prometheus)"; exit 1; }
	@for f in deploy/testdata/helm/*.yaml; do \
	  $(BIN)/helm lint --quiet --strict --kube-version 1.31.0 deploy/helm/idemcoord -f $$f >/dev/null || \
	    { $(BIN)/helm lint --strict --kube-version 1.31.0 deploy/helm/idemcoord -f $$f; exit 1; }; \
	done
	HELM=$(BIN)/helm IDEMCOORD_BIN=$(BIN)/idemcoord go test -count=1 ./deploy/

## helm: install only the pinned helm into ./bin (built from tools/helm)
.PHONY: helm
helm: $(BIN)/.helm-$(HELM_VERSION)
# The ldflags are those of helm's own release build: its version, and the Kubernetes version
# (that of its client-go, v0.34) that `helm template` and `helm lint` assume without --kube-version.
HELM_LDFLAGS := -X helm.sh/helm/v3/internal/version.version=$(HELM_VERSION) \
  -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=34 \
  -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=34
$(BIN)/.helm-$(HELM_VERSION): tools/helm/go.mod
	@grep -Fqw 'helm.sh/helm/v3 $(HELM_VERSION)' tools/helm/go.mod || \
	  { echo "tools/helm/go.mod does not require helm.sh/helm/v3 $(HELM_VERSION)"; exit 1; }
	cd tools/helm && GOBIN=$(BIN) go install -ldflags "$(HELM_LDFLAGS)" helm.sh/helm/v3/cmd/helm
	@touch $@

## lint: gofmt, go vet, golangci-lint (.golangci.yml: every linter but those it turns off, each with its reason), buf lint, ESLint on the Node
## library and the Express example (clients/node/eslint.config.mjs; needs `npm ci --prefix clients/node`),
## mypy --strict and flake8 on the Python library and its tests (Debian: apt-get install mypy flake8), generated
## code up to date
lint: tools check-generated
	@out=$$(gofmt -l $$(git ls-files '*.go' | grep -v '^gen/') 2>&1); \
	  if [ -n "$$out" ]; then echo "gofmt needed on:"; echo "$$out"; exit 1; fi
	go vet $(GO_PACKAGES)
	$(BIN)/golangci-lint run $(GO_PACKAGES)
	$(BIN)/buf lint
	/usr/bin/python3 -m mypy --strict --config-file clients/python/pyproject.toml clients/python/idemcoord
	cd clients/python && /usr/bin/python3 -m flake8 idemcoord tests
	npm --prefix clients/node run --silent lint

# The Node and Python client libraries load the API at run time from a
# FileDescriptorSet of proto/ and third_party/ (no protoc, no generated code).
DESCRIPTOR_SETS := clients/node/idempotency.binpb clients/python/idemcoord/idempotency.binpb
# Copies of clients/testdata/shared_tables.json (the tables the libraries share) inside packages.
SHARED_TABLES := clients/node/shared_tables.json clients/python/idemcoord/shared_tables.json

## generate: regenerate gen/ and the client libraries' descriptor sets from proto/
generate: tools
	rm -rf gen/idempotency
	$(BIN)/buf generate
	for f in $(DESCRIPTOR_SETS); do $(BIN)/buf build --as-file-descriptor-set --exclude-source-info -o $$f || exit 1; done
	for f in $(SHARED_TABLES); do cp clients/testdata/shared_tables.json $$f || exit 1; done

## check-generated: fail when gen/ or a descriptor set differs from what proto/ generates
check-generated: tools
	@tmp=$$(mktemp -d); trap 'rm -rf $$tmp' EXIT; \
	  $(BIN)/buf generate -o $$tmp && \
	  if ! diff -r gen $$tmp/gen >/dev/null; then \
	    diff -r gen $$tmp/gen | head -20; \
	    echo "gen/ is stale: run 'make generate' and commit the result"; exit 1; \
	  fi; \
	  $(BIN)/buf build --as-file-descriptor-set --exclude-source-info -o $$tmp/api.binpb && \
	  for f in $(DESCRIPTOR_SETS); do \
	    cmp -s $$f $$tmp/api.binpb || { echo "$$f is stale: run 'make generate' and commit the result"; exit 1; }; \
	  done; \
	  for f in $(SHARED_TABLES); do \
	    cmp -s $$f clients/testdata/shared_tables.json || { echo "$$f is stale: run 'make generate' and commit the result"; exit 1; }; \
	  done

## tools: install the pinned tools (buf, protoc-gen-go, protoc-gen-go-grpc, grpcurl, toxiproxy-server, helm,
## golangci-lint) into ./bin
tools: $(BIN)/.buf-$(BUF_VERSION) $(BIN)/.protoc-gen-go-$(PROTOC_GEN_GO_VERSION) \
       $(BIN)/.protoc-gen-go-grpc-$(PROTOC_GEN_GO_GRPC_VERSION) $(BIN)/.grpcurl-$(GRPCURL_VERSION) \
       $(BIN)/.toxiproxy-$(TOXIPROXY_VERSION) $(BIN)/.helm-$(HELM_VERSION) $(BIN)/.golangci-lint-$(GOLANGCI_LINT_VERSION)

$(BIN)/.buf-$(BUF_VERSION):
	GOBIN=$(BIN) go install github.com/bufbuild/buf/cmd/buf@$(BUF_VERSION)
	@touch $@
$(BIN)/.protoc-gen-go-$(PROTOC_GEN_GO_VERSION):
	GOBIN=$(BIN) go install google.golang.org/protobuf/cmd/protoc-gen-go@$(PROTOC_GEN_GO_VERSION)
	@touch $@
$(BIN)/.protoc-gen-go-grpc-$(PROTOC_GEN_GO_GRPC_VERSION):
	GOBIN=$(BIN) go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@$(PROTOC_GEN_GO_GRPC_VERSION)
	@touch $@
$(BIN)/.golangci-lint-$(GOLANGCI_LINT_VERSION):
	GOBIN=$(BIN) go install github.com/golangci/golangci-lint/v2/cmd/golangci-lint@$(GOLANGCI_LINT_VERSION)
	@touch $@
$(BIN)/.grpcurl-$(GRPCURL_VERSION):
	GOBIN=$(BIN) go install github.com/fullstorydev/grpcurl/cmd/grpcurl@$(GRPCURL_VERSION)
	@touch $@
# toxiproxy's server (the fault proxy of chaos/TestRetryingClients) installs as
# "server"; it lands in ./bin as toxiproxy-server. Kept out of go.mod.
$(BIN)/.toxiproxy-$(TOXIPROXY_VERSION):
	@tmp=$$(mktemp -d); trap 'rm -rf $$tmp' EXIT; \
	  set -x; GOBIN=$$tmp go install github.com/Shopify/toxiproxy/v2/cmd/server@$(TOXIPROXY_VERSION) && \
	  mv $$tmp/server $(BIN)/toxiproxy-server
	@touch $@

## grpcurl: install only the pinned grpcurl into ./bin (for the README's session; `make tools` builds every tool)
.PHONY: grpcurl
grpcurl: $(BIN)/.grpcurl-$(GRPCURL_VERSION)

## bench: durable PostgreSQL + the idemcoord binary (default settings) vs the lean hand-written table
## (alternated with the coordinator's cells) and vs direct SQL on the coordinator's table, at
## 1/16/64/256 callers, ghz, 10M-record scale check (gauge cost, reaper on a backlog); prints the table
## with every goal met / not met, writes bench/results/<UTC time>.json and latest.json (about 6 min).
bench: build $(BIN)/.ghz-$(GHZ_VERSION)
	@commit=$$(git rev-parse --short=12 HEAD 2>/dev/null) && { git diff --quiet HEAD -- || commit=$$commit-dirty; }; \
	  set -x; go run ./bench -coordinator $(BIN)/idemcoord -ghz $(BIN)/ghz -commit "$$commit" $(BENCH_FLAGS)

## bench-quick: the same in a minute or two (16/64/256 callers, 0.5s+2s cells, 200k scale records, no ghz);
## rougher figures, and the 10M-record goals are not measured
.PHONY: bench-quick
bench-quick: build
	@commit=$$(git rev-parse --short=12 HEAD 2>/dev/null) && { git diff --quiet HEAD -- || commit=$$commit-dirty; }; \
	  set -x; go run ./bench -quick -coordinator $(BIN)/idemcoord -commit "$$commit" $(BENCH_FLAGS)

$(BIN)/.ghz-$(GHZ_VERSION):
	GOBIN=$(BIN) go install github.com/bojand/ghz/cmd/ghz@$(GHZ_VERSION)
	@touch $@

## console-screenshot: regenerate the console pictures of docs/console.md (docs/console-*.png) in headless Chromium
.PHONY: console-screenshot
console-screenshot:
	CI=true IDEMCOORD_CONSOLE_SCREENSHOTS=$(CURDIR)/docs go test -count=1 -run '^TestBrowserResolvesUnknown$$' ./console/

## clean-data: delete the local clusters that `make run` and `make run-citus` keep under .data/
clean-data:
	rm -rf .data
