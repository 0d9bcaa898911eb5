//! The official MCP SDK clients as real agents: each runs as a process against a URL and reports
//! what its SDK handed back, one JSON object per step.

use std::time::Duration;

use serde_json::Value;

use crate::paths::workspace_root;

/// Runs `tests/python/client.py URL STEPS…` (the official Python SDK): one object per step
/// until the first that did not return a result (`{"step", "ok"|"mcp_error"|"exception"}`).
pub async fn python(url: &str, steps: &[&str]) -> Vec<Value> {
    run_python(&[], url, steps).await
}

/// [`python`] with the SDK's `Client(mode=MODE)` doing the handshake: `"auto"` (probes
/// `server/discover`, falls back to `initialize`) or a 2026-era version (`"2026-07-28"`); step
/// `initialize` then reports `{"protocolVersion", "serverInfo"}` as negotiated.
pub async fn python_in_mode(url: &str, mode: &str, steps: &[&str]) -> Vec<Value> {
    run_python(&["--mode", mode], url, steps).await
}

async fn run_python(options: &[&str], url: &str, steps: &[&str]) -> Vec<Value> {
    let python = workspace_root().join(".venv/bin/python");
    let script = workspace_root().join("tests/python/client.py");
    let out = tokio::time::timeout(
        Duration::from_secs(90),
        tokio::process::Command::new(&python)
            .arg(&script)
            .args(options)
            .arg(url)
            .args(steps)
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the python client finished within 90 s")
    .expect("the python client runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<Value> = stdout
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    assert!(
        !lines.is_empty(),
        "the python client printed nothing; stderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    lines
}
