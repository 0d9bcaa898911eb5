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

test: build lint
	$(CARGO) test $(PROFILE) --workspace -- --test-threads=$${TEST_THREADS:-2}

demo: build
	@bash scripts/demo.sh

clean:
	$(CARGO) clean
	rm -rf tests/logs .toolgate

# make bench: every suite, full size (about 15 minutes), writes bench/results.json and the plots
# in bench/out/; make bench-quick: the same suites at a reduced size (about a minute), a smoke
# test CI runs, writing bench/out/results-quick.json. Both build the do-nothing wasm filter and
# the probe filter (bench/noop-filter) that the data-plane suite compares the toolgate filter
# with.
# Property-based fuzzing (proptest; cargo-fuzz needs a nightly toolchain): the JSON-RPC request
# parser, the SSE scanner, reply synthesis and the depth scan (filter/tests/fuzz.rs), instance
# metadata and policy parsing (model/tests/fuzz.rs). make test runs a few thousand cases per
# property; make fuzz-smoke about 30 s per property on 2 cores (1.2 million cases per filter
# property, 3 million per model property; CI runs it); make fuzz 20 times that, about 10
# minutes per property. Case counts, not seconds: proptest has no time budget.
.PHONY: fuzz-smoke fuzz
FUZZ_SCALE ?= 1

fuzz-smoke: setup
	TOOLGATE_FUZZ_CASES=$$((1200000 * $(FUZZ_SCALE))) $(CARGO) test $(PROFILE) -p toolgate-filter --test fuzz -- --test-threads=2
	TOOLGATE_FUZZ_CASES=$$((3000000 * $(FUZZ_SCALE))) $(CARGO) test $(PROFILE) -p toolgate-model --test fuzz -- --test-threads=2

fuzz:
	$(MAKE) fuzz-smoke FUZZ_SCALE=20

.PHONY: bench bench-quick bench-filters

bench-filters:
	$(CARGO) build $(PROFILE) -p toolgate-noop-filter --target wasm32-wasip1 --lib --examples

bench: build bench-filters
	target/release/toolgate-bench

bench-quick: build bench-filters
	target/release/toolgate-bench --quick --json bench/out/results-quick.json
