//! What one admitted 1 KB `tools/call` costs the filter's own code natively (no VM, no host
//! crossings): `cargo test --release -p toolgate-filter a_call_costs -- --ignored --nocapture`,
//! and under `perf record` for where the time goes.

use super::*;

#[test]
#[ignore = "a measurement, not a check"]
fn a_call_costs() {
    let mut w = Worker::new();
    let pad = "x".repeat(900);
    let body = format!(
        r#"{{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{{"name":"read_order","arguments":{{"pad":"{pad}"}}}}}}"#
    );
    let text = "y".repeat(2000);
    let answer = format!(
        r#"{{"jsonrpc":"2.0","id":7,"result":{{"content":[{{"type":"text","text":"{text}"}}],"isError":false}}}}"#
    );
    let len = answer.len().to_string();
    let n: u32 = std::env::var("CALLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200_000);
    let started = std::time::Instant::now();
    for _ in 0..n {
        let mut f = w.request("orders", &[], &body);
        assert!(f.went_upstream());
        f.respond(
            200,
            &[
                ("content-type", "application/json"),
                ("content-length", &len),
            ],
            Some(&answer),
        );
    }
    let per_call = started.elapsed() / n;
    println!("{n} calls, {per_call:?} per call (the test host's own work included)");
}
