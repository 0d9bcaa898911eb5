# toolgate: the two commands are `make demo` and `make test`.
SHELL := /bin/bash
CARGO ?= cargo
# Tests, binaries and demo all use the release profile, so dependencies compile once.
PROFILE := --release

.PHONY: setup build lint test demo clean

setup:
	@bash scripts/setup.sh

build: setup
	$(CARGO) build $(PROFILE) --workspace --bins
	$(CARGO) build $(PROFILE) -p toolgate-filter --target wasm32-wasip1

lint: setup
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy $(PROFILE) --workspace --all-targets -- -D warnings
	$(CARGO) clippy $(PROFILE) -p toolgate-filter --target wasm32-wasip1 -- -D warnings

# The tests need toolgate-xds's failpoints (xds-server/src/failpoint.rs, cargo feature
# `failpoints`). `make build` leaves them out, as the Docker image does; `cargo test` turns them
# on through toolgate-xds's dev-dependency on itself, and so rebuilds target/release/toolgate-xds
# with them before the end-to-end tests in tests/ run it (that binary is a test build until the
# next `make build`).
test: build lint
	$(CARGO) test $(PROFILE) --workspace -- --test-threads=$${TEST_THREADS:-2}
	@echo "make test: discovery, fleet, security and upstream credentials (SDS) again, Envoy speaking state-of-the-world ADS"
	TOOLGATE_TEST_XDS_PROTOCOL=sotw $(CARGO) test $(PROFILE) --workspace \
		--test gateway -- discovery:: fleet:: security:: upstream_credentials:: --test-threads=$${TEST_THREADS:-2}

demo: build
	@bash scripts/demo.sh

# make deploy-render: the Envoy bootstraps under deploy/ (Compose's envoy.json, the Kubernetes
# ConfigMap) written from `toolgate-xds bootstrap`, the code the tests' Envoys start from, so the
# listener's security settings exist once. `make test` fails when the committed files differ.
.PHONY: deploy-render
deploy-render: build
	@bash scripts/render-deploy.sh

clean:
	$(CARGO) clean
	rm -rf tests/logs .toolgate

# make bench: every suite, full size (about 15 minutes), writes bench/results.json and the plots
# in bench/out/; make bench-quick: the same suites at a reduced size (about a minute), a smoke
# test CI runs, writing bench/out/results-quick.json. Both build the do-nothing wasm filter and
# the probe filter (bench/noop-filter) that the data-plane suite compares the toolgate filter
# with.
# Property-based fuzzing (proptest; cargo-fuzz needs a nightly toolchain) of five targets: the
# JSON-RPC request parser (jsonrpc), the SSE scanner (sse), reply synthesis (reply) in
# filter/tests/fuzz.rs, instance metadata (metadata) and policy parsing (policy) in
# model/tests/fuzz.rs. make test runs a few thousand cases per property; scripts/fuzz.sh gives
# each target a time budget on two workers and prints the cases it executed: make fuzz-smoke
# 30 s per target (CI runs it), make fuzz 10 minutes per target (30 minutes in all).
.PHONY: fuzz-smoke fuzz

fuzz-smoke: setup
	bash scripts/fuzz.sh 30

fuzz: setup
	bash scripts/fuzz.sh 600

# Chaos run (tests/src/bin/toolgate-chaos): a three-member etcd cluster, toolgate-xds, Envoy
# with the filter and a lab service scaled 5 -> 50 -> 5 under steady agent load, while pods are
# killed, crash, restart and freeze, toolgate-xds is cut off from etcd (and etcd compacted
# meanwhile) and restarted, Envoy hot-restarts and the etcd leader is killed. Prints the
# invariants and exits non-zero if one failed; logs and report.json in tests/logs/chaos/.
# make chaos runs 10 minutes; make chaos-quick 2 (CI runs it, and chaos-quick-sotw for 1 under
# state-of-the-world ADS). CHAOS_ARGS adds flags, e.g.
# CHAOS_ARGS="--seed 42" to repeat a run's fault schedule.
.PHONY: chaos chaos-quick chaos-quick-sotw

chaos: build
	target/release/toolgate-chaos --duration 10m $(CHAOS_ARGS)

chaos-quick: build
	target/release/toolgate-chaos --duration 2m $(CHAOS_ARGS)

# The chaos run's shortest form with Envoy speaking state-of-the-world ADS (CI runs it after
# chaos-quick, which uses the default, delta).
chaos-quick-sotw: build
	TOOLGATE_TEST_XDS_PROTOCOL=sotw target/release/toolgate-chaos --duration 1m $(CHAOS_ARGS)

# make abuse: the hostile-agent and fail-closed tests alone, against real etcd, toolgate-xds,
# Envoy and an official Python SDK server: duplicate keys, non-finite numbers, HTTP/2 trailers
# and resets, batches, lying headers, client faults, made-up names, forged session ids
# (abuse.rs); other methods, compressed answers, cancelled calls, non-text headers, unreadable
# listings, refused configurations (fail_closed.rs); operators' changes that would switch
# judgment off (fail_closed_config.rs); held sessions shared, unbounded or revived
# (fail_closed_sessions.rs). make test runs them too, so they stay closed in CI.
.PHONY: abuse

abuse: build
	$(CARGO) test $(PROFILE) -p toolgate-tests --test gateway -- abuse:: fail_closed:: fail_closed_config:: fail_closed_sessions:: \
		--test-threads=$${TEST_THREADS:-2}

.PHONY: bench bench-quick bench-filters

bench-filters:
	$(CARGO) build $(PROFILE) -p toolgate-noop-filter --target wasm32-wasip1 --lib --examples

bench: build bench-filters
	target/release/toolgate-bench

bench-quick: build bench-filters
	target/release/toolgate-bench --quick --json bench/out/results-quick.json

# make docs: the book in docs/ (mdBook) built into target/book/. mdBook is installed with cargo
# into target/tools/ at a pinned version, without its default features (no server, watcher or
# search index), the first time only (about 3 minutes on 2 cores). `mdbook build -d` is relative
# to the book's root, hence ../target/book.
MDBOOK_VERSION := 0.4.52
MDBOOK := target/tools/bin/mdbook
.PHONY: docs

docs:
	@if [ "$$($(MDBOOK) --version 2>/dev/null)" != "mdbook v$(MDBOOK_VERSION)" ]; then \
		$(CARGO) install --locked mdbook --version $(MDBOOK_VERSION) --no-default-features \
			--root target/tools; \
	fi
	$(MDBOOK) build docs -d ../target/book
	@echo "make docs: target/book/index.html"
