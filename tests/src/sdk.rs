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

/// [`python`] with `client.py` options first (`--mode MODE`, `--elicit-answer TEXT`).
pub async fn python_with(options: &[&str], url: &str, steps: &[&str]) -> Vec<Value> {
    run_python(options, url, steps).await
}

/// The result the python client reported for `step`; panics with every report when the step
/// gave none (an MCP error, an exception, or no report at all). The test's [`TestEnv`] prints
/// its processes' logs as the panic unwinds.
///
/// [`TestEnv`]: crate::TestEnv
pub fn step_ok<'a>(lines: &'a [Value], step: &str) -> &'a Value {
    match lines
        .iter()
        .find(|l| l["step"] == step)
        .and_then(|l| l.get("ok"))
    {
        Some(ok) => ok,
        None => panic!("python step {step} gave no result: {lines:#?}"),
    }
}

/// `tests/python/client.py` running, its step reports read as they come: for a test that acts
/// while a step is in flight (kills a server under a call).
pub struct PythonLive {
    child: tokio::process::Child,
    lines: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
}

impl PythonLive {
    pub fn spawn(options: &[&str], url: &str, steps: &[&str]) -> PythonLive {
        let mut child = tokio::process::Command::new(workspace_root().join(".venv/bin/python"))
            .arg(workspace_root().join("tests/python/client.py"))
            .args(options)
            .arg(url)
            .args(steps)
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("the python client runs");
        let stdout = child.stdout.take().expect("piped stdout");
        PythonLive {
            child,
            lines: tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(stdout)),
        }
    }

    /// The next step's report, within `within`; `None` once the client printed its last.
    pub async fn next(&mut self, within: Duration) -> Option<Value> {
        loop {
            let line = tokio::time::timeout(within, self.lines.next_line())
                .await
                .expect("the python client reported its next step in time")
                .ok()??;
            if let Ok(v) = serde_json::from_str(&line) {
                return Some(v);
            }
        }
    }

    pub async fn finish(mut self) {
        let _ = tokio::time::timeout(Duration::from_secs(30), self.child.wait()).await;
    }
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
