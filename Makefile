# shunt: build, generate, test. `make help` lists the targets.
GO ?= go
BIN := bin/shunt
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)

.PHONY: help deps build generate test test-kernels vet lint race fuzz try compat compat-bench package test-package manifests dashboard-snapshot clean

help:
	@echo "make deps      install build and test dependencies (Debian 12, as root)"
	@echo "make build     build the static binary $(BIN)"
	@echo "make generate  recompile the BPF programs (bpf2go; the clang of bpf/CLANG_VERSION, else ANY_CLANG=1)"
	@echo "make manifests render deploy/kubernetes/shunt.yaml from the Helm chart deploy/helm/shunt"
	@echo "make test      go vet and every test (as root, on the real kernel)"
	@echo "make lint      golangci-lint (pinned; .golangci.yml): errcheck, govet, staticcheck, unused, goimports"
	@echo "make race      proxy, daemon, metrics, agent, kube, guard, splice, fanout, cmd/shunt and two internal packages under the race detector (as root, ~8 min; CI runs it)"
	@echo "make fuzz      search the parsers of untrusted input (ruleset, agent config, daemon requests and hand-over), FUZZTIME each (30s, or a count like 2000x; CI: 2000x)"
	@echo "make try       build, then bypass one loopback connection and show it"
	@echo "make compat    real programs (Redis, memcached, PostgreSQL, nginx, HAProxy, Python) through shunt (as root)"
	@echo "make compat-bench  their own benchmark clients, plain TCP against shunt (and unix sockets), interleaved (as root, ~10 min)"
	@echo "make package   build out/package/shunt_VERSION_amd64.deb (nfpm): binary, shunt-agent unit, config, completions"
	@echo "make test-package  build the .deb, install it here, check it, run its unit's command under its capabilities, purge it (as root)"
	@echo "make test-kernels  the kernel-dependent tests on Debian's 6.1 and 6.12 kernels under qemu (as root, ~90 min without KVM; KERNELS=6.1 for one; CI runs KERNELS=6.1 ROWS=ci, ROWS=rest the others)"
	@echo "make test-k8s  a one-node Kubernetes cluster built from Go modules (etcd, API server, controller manager, scheduler, kube-proxy in nftables and iptables mode, kubelet and containerd): the chart, the agent as a DaemonSet pod and pods' traffic (as root; ~13 min to build once)"
	@echo "make dashboard-snapshot  draw the Grafana dashboard on real data into docs/img/dashboard.png (as root, ~3 min)"

deps:
	./scripts/deps.sh

build:
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags "-s -w -X main.version=$(VERSION)" -o $(BIN) ./cmd/shunt

# CI compares the committed objects with what bpf/ compiles to, byte for
# byte: they are what one clang makes (bpf/CLANG_VERSION, Debian 12's).
CLANG_VERSION := $(shell cat bpf/CLANG_VERSION)
generate:
	@v=$$(clang --version 2>/dev/null | sed -n 's/.*clang version \([0-9.]*\).*/\1/p' | head -1); \
	if [ "$$v" != "$(CLANG_VERSION)" ] && [ -z "$(ANY_CLANG)" ]; then \
	  echo "make generate: clang $${v:-is missing} here, the committed objects are clang $(CLANG_VERSION)'s (Debian 12's clang; or ANY_CLANG=1 to remake every object with this one and commit them)" >&2; \
	  exit 2; \
	fi
	$(GO) generate ./...

manifests:
	$(GO) test ./kube -run '^TestChartRendersTheManifests$$' -count=1 -update

vet:
	$(GO) vet -tags kernelmatrix,k8snode ./...

# golangci-lint, pinned; go run builds it once into the build cache (about
# 3 min on a fresh machine). .golangci.yml says what it runs: errcheck,
# govet, ineffassign, staticcheck, unused, and goimports for the layout.
GOLANGCI := github.com/golangci/golangci-lint/v2/cmd/golangci-lint@v2.15.0

lint:
	$(GO) run $(GOLANGCI) run ./...

# Packages that run goroutines of their own (servers, relays, readers,
# watchers, the commands that start them) under the race detector, whole
# suites; CI runs them. fanout's load tests run at their -short size under
# -race (at full size one grew past 21 GB resident).
RACE_PKGS := ./proxy ./daemon ./metrics ./agent ./kube ./guard ./splice ./fanout ./cmd/shunt ./internal/readlimit ./internal/runlock

race:
	$(GO) test -race -count=1 -timeout 20m $(RACE_PKGS)

# The parsers of what a user or a client hands shunt. `go test` runs each
# target's seeds and the inputs it once failed on (testdata/fuzz); this
# searches for new ones.
FUZZTIME ?= 30s
fuzz:
	$(GO) test ./policy -run '^$$' -fuzz '^FuzzParse$$' -fuzztime $(FUZZTIME)
	$(GO) test ./agent -run '^$$' -fuzz '^FuzzParseConfig$$' -fuzztime $(FUZZTIME)
	$(GO) test ./daemon -run '^$$' -fuzz '^FuzzRequest$$' -fuzztime $(FUZZTIME)
	$(GO) test ./daemon -run '^$$' -fuzz '^FuzzHandoverState$$' -fuzztime $(FUZZTIME)

test: vet
	$(GO) test -count=1 -timeout 20m ./...

# A one-node control plane built from Kubernetes' Go modules (k8snode/).
test-k8s:
	./scripts/k8s.sh test

# KERNELS: names from scripts/kernels/matrix (all when empty). ROWS: all, ci
# (the rows of scripts/kernels/tests tagged :ci) or rest. CI runs
# KERNELS=6.1 ROWS=ci, to stay within its hour; ROWS=rest before submitting.
KERNELS ?=
ROWS ?= all
test-kernels:
	./scripts/kernels.sh setup
	ROWS=$(ROWS) ./scripts/kernels.sh test $(KERNELS)

compat:
	$(GO) test -count=1 -v -run . ./compat

compat-bench:
	$(GO) test -count=1 -run '^$$' -bench . -benchtime 1x -v ./compat

# nfpm, pinned; go run builds it once into the build cache.
NFPM := github.com/goreleaser/nfpm/v2/cmd/nfpm@v2.43.1
# A Debian version must start with a digit.
DEB_VERSION ?= 0~git$(shell git log -1 --format=%cd.%h --date=format:%Y%m%d 2>/dev/null || echo 0)

package: build
	rm -rf out/package && mkdir -p out/package/completions
	./$(BIN) completion bash > out/package/completions/shunt.bash
	./$(BIN) completion zsh > out/package/completions/_shunt
	./$(BIN) completion fish > out/package/completions/shunt.fish
	SHUNT_DEB_VERSION=$(DEB_VERSION) $(GO) run $(NFPM) pkg --config packaging/nfpm.yaml --packager deb --target out/package/

test-package: package
	./scripts/package-test.sh out/package/shunt_*_amd64.deb

try: build
	./scripts/try.sh $(BIN)

dashboard-snapshot:
	./scripts/dashboard-snapshot.sh

clean:
	rm -rf bin
