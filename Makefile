# shunt: build, generate, test. `make help` lists the targets.
GO ?= go
BIN := bin/shunt
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)

.PHONY: help deps build generate test test-kernels vet try compat compat-bench clean

help:
	@echo "make deps      install build and test dependencies (Debian 12, as root)"
	@echo "make build     build the static binary $(BIN)"
	@echo "make generate  recompile the BPF programs (bpf2go)"
	@echo "make test      go vet and every test (as root, on the real kernel)"
	@echo "make try       build, then bypass one loopback connection and show it"
	@echo "make compat    real programs (Redis, memcached, PostgreSQL, nginx, HAProxy, Python) through shunt (as root)"
	@echo "make compat-bench  their own benchmark clients, plain TCP against shunt, interleaved (as root, ~5 min)"
	@echo "make test-kernels  the kernel-dependent tests on Debian's 6.1 and 6.12 kernels under qemu (as root, ~10 min)"

deps:
	./scripts/deps.sh

build:
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags "-s -w -X main.version=$(VERSION)" -o $(BIN) ./cmd/shunt

generate:
	$(GO) generate ./...

vet:
	$(GO) vet ./...

test: vet
	$(GO) test -count=1 -timeout 20m ./...

test-kernels:
	./scripts/kernels.sh setup
	./scripts/kernels.sh test

compat:
	$(GO) test -count=1 -v -run . ./compat

compat-bench:
	$(GO) test -count=1 -run '^$$' -bench . -benchtime 1x -v ./compat

try: build
	./scripts/try.sh $(BIN)

clean:
	rm -rf bin
