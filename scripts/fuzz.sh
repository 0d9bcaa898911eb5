#!/usr/bin/env bash
# Time-budgeted fuzzing of the five parser targets with the proptest properties in
# filter/tests/fuzz.rs and model/tests/fuzz.rs. proptest has no time budget of its own, so each
# target runs its properties in batches (a fresh random seed per batch) until SECONDS have
# passed, on two workers (one per core), and reports how many cases it executed.
#
#   scripts/fuzz.sh SECONDS        e.g. 30 (make fuzz-smoke) or 600 (make fuzz)
#
# A property is named for its target (jsonrpc_, sse_, reply_, metadata_, policy_), which is how
# a batch picks it. Any failing case stops the run with proptest's minimal failing input.
set -euo pipefail
cd "$(dirname "$0")/.."

budget=${1:?usage: scripts/fuzz.sh SECONDS}
case "$budget" in '' | *[!0-9]*) echo "fuzz.sh: SECONDS must be a whole number, got '$budget'" >&2; exit 2 ;; esac
CARGO=${CARGO:-cargo}
out=target/fuzz-logs
rm -rf "$out" && mkdir -p "$out"

# The test binaries, built once; the batches then run them directly.
binary() {
    $CARGO test --release -p "$1" --test fuzz --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "fuzz":
        print(m["executable"])'
}
$CARGO test --release -p toolgate-filter -p toolgate-model --test fuzz --no-run
filter_bin=$(binary toolgate-filter)
model_bin=$(binary toolgate-model)

now_ms() { date +%s%3N; }

# run_target NAME BINARY: batches until the budget is spent; writes $out/NAME.result.
run_target() {
    local name=$1 bin=$2
    local props
    props=$("$bin" --list 2>/dev/null | grep -c "^${name}_.*: test$" || true)
    if [ "$props" -eq 0 ]; then
        echo "fuzz.sh: no property named ${name}_* in $bin" >&2
        return 1
    fi
    local cases=2000 total=0 batches=0 start now elapsed took
    start=$(now_ms)
    while :; do
        local t0
        t0=$(now_ms)
        if ! TOOLGATE_FUZZ_CASES=$cases "$bin" "${name}_" --test-threads=1 >"$out/$name.batch.log" 2>&1; then
            echo "fuzz.sh: target $name FAILED after $total cases per property; its output:" >&2
            cat "$out/$name.batch.log" >&2
            echo "failed" >"$out/$name.result"
            return 1
        fi
        now=$(now_ms)
        total=$((total + cases))
        batches=$((batches + 1))
        elapsed=$((now - start))
        [ "$elapsed" -ge $((budget * 1000)) ] && break
        # Aim each batch at about 15 s (or what is left of the budget), so a batch's fixed
        # start-up cost stays small and the budget is not overshot by much.
        took=$((now - t0 + 1))
        local left=$((budget * 1000 - elapsed))
        local aim=$((left < 15000 ? left : 15000))
        cases=$((cases * aim / took))
        [ "$cases" -lt 1000 ] && cases=1000
    done
    echo "$name $props $total $batches $elapsed" >"$out/$name.result"
}

echo "fuzzing each target for ${budget} s on 2 workers (logs in $out/)"
pids=()
{ run_target jsonrpc "$filter_bin" && run_target reply "$filter_bin" && run_target policy "$model_bin"; } &
pids+=($!)
{ run_target sse "$filter_bin" && run_target metadata "$model_bin"; } &
pids+=($!)
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done

printf '\n%-9s %10s %9s %22s %16s\n' target properties seconds "cases per property" "cases in total"
for name in jsonrpc sse reply metadata policy; do
    if [ ! -f "$out/$name.result" ]; then
        printf '%-9s not run (an earlier target failed)\n' "$name"
        continue
    fi
    read -r n props total batches elapsed <"$out/$name.result" || true
    if [ "$n" = failed ]; then
        printf '%-9s FAILED\n' "$name"
        continue
    fi
    printf '%-9s %10d %9d %22d %16d   (%d batches)\n' "$name" "$props" $((elapsed / 1000)) "$total" $((total * props)) "$batches"
done
exit $status
