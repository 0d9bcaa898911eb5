//! The official TypeScript MCP SDKs as clients: `tests/node/call.mjs` run under Node, with the
//! packages `make setup` installs into `tests/node/node_modules` (pinned by its lockfile).
//!
//! ```text
//! let run = NodeClient::new(Sdk::V2)
//!     .protocol_version("2025-06-18")
//!     .step("tools/call", json!({"name": "echo", "arguments": {}}))
//!     .run(&envoy.url("orders"))
//!     .await;
//! let result = run.result("tools/call");
//! ```

use std::path::PathBuf;
use std::time::Duration;

use serde_json::Value;

use crate::paths::workspace_root;

/// Which SDK `call.mjs` drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sdk {
    /// `@modelcontextprotocol/sdk` 1.x.
    V1,
    /// `@modelcontextprotocol/client` 2.x.
    V2,
}

impl Sdk {
    pub const ALL: [Sdk; 2] = [Sdk::V1, Sdk::V2];

    fn flag(self) -> &'static str {
        match self {
            Sdk::V1 => "1",
            Sdk::V2 => "2",
        }
    }
}

/// One run of `call.mjs`: connect, then the steps in order.
#[derive(Debug, Clone)]
pub struct NodeClient {
    sdk: Sdk,
    protocol_version: Option<String>,
    steps: Vec<(String, Option<Value>)>,
    timeout: Duration,
}

/// What the SDK reported: the script's JSON (see `tests/node/call.mjs`), its exit code and
/// its stderr.
#[derive(Debug, Clone)]
pub struct NodeRun {
    pub report: Value,
    /// 0: every step succeeded; 1: one failed (its error is in the report).
    pub exit_code: Option<i32>,
    pub stderr: String,
}

impl NodeClient {
    pub fn new(sdk: Sdk) -> NodeClient {
        NodeClient {
            sdk,
            protocol_version: None,
            steps: Vec::new(),
            timeout: Duration::from_secs(20),
        }
    }

    /// The protocol version the client offers (2.x pins a 2026-era one via `server/discover`).
    pub fn protocol_version(mut self, version: &str) -> Self {
        self.protocol_version = Some(version.to_string());
        self
    }

    /// A request with params (`tools/call`, `{"name": ..., "arguments": ...}`).
    pub fn step(mut self, method: &str, params: Value) -> Self {
        self.steps.push((method.to_string(), Some(params)));
        self
    }

    /// A request without params (`tools/list`, `ping`).
    pub fn method(mut self, method: &str) -> Self {
        self.steps.push((method.to_string(), None));
        self
    }

    /// The SDK's own request timeout and the script's deadline; the process is killed a few
    /// seconds after it.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    fn args(&self, url: &str) -> Vec<String> {
        let mut args = vec![
            script().to_string_lossy().into_owned(),
            "--sdk".into(),
            self.sdk.flag().into(),
            "--timeout-ms".into(),
            self.timeout.as_millis().to_string(),
        ];
        if let Some(v) = &self.protocol_version {
            args.extend(["--protocol-version".into(), v.clone()]);
        }
        args.push(url.to_string());
        for (method, params) in &self.steps {
            args.push(method.clone());
            if let Some(p) = params {
                args.push(p.to_string());
            }
        }
        args
    }

    /// Runs the script against `url`. Panics if Node cannot run it, if it exceeds its
    /// deadline by more than 5 s, or if it prints no report (a usage error).
    pub async fn run(&self, url: &str) -> NodeRun {
        assert!(
            workspace_root()
                .join("tests/node/node_modules/@modelcontextprotocol")
                .is_dir(),
            "tests/node/node_modules is missing: run `make setup` first"
        );
        let args = self.args(url);
        let out = tokio::time::timeout(
            self.timeout + Duration::from_secs(5),
            tokio::process::Command::new("node")
                .args(&args)
                .kill_on_drop(true)
                .output(),
        )
        .await
        .unwrap_or_else(|_| panic!("node {} did not finish", args.join(" ")))
        .unwrap_or_else(|e| panic!("running node (is Node 20 installed?): {e}"));
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        let report: Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| {
            panic!(
                "node {} printed no report ({e}), exit {:?}\nstdout: {stdout}\nstderr: {stderr}",
                args.join(" "),
                out.status.code()
            )
        });
        NodeRun {
            report,
            exit_code: out.status.code(),
            stderr,
        }
    }
}

fn script() -> PathBuf {
    workspace_root().join("tests/node/call.mjs")
}

impl NodeRun {
    /// The first step named `method` (`connect` is the handshake).
    pub fn step(&self, method: &str) -> Option<&Value> {
        self.report["steps"]
            .as_array()?
            .iter()
            .find(|s| s["method"] == method)
    }

    /// The result the SDK returned for `method`; panics with the report if it raised instead.
    pub fn result(&self, method: &str) -> &Value {
        match self.step(method) {
            Some(s) if s["ok"] == true => &s["result"],
            _ => panic!("{method} gave no result: {}", self.report),
        }
    }

    /// The error the SDK raised for `method` (`name`, `message`, `code`, `status`, `data`);
    /// panics with the report if it returned a result instead.
    pub fn error(&self, method: &str) -> &Value {
        match self.step(method) {
            Some(s) if s["ok"] == false => &s["error"],
            _ => panic!("{method} raised no error: {}", self.report),
        }
    }

    /// The protocol version the SDK negotiated.
    pub fn protocol_version(&self) -> Option<&str> {
        self.report["protocolVersion"].as_str()
    }

    /// `@modelcontextprotocol/sdk 1.32.2` and the like.
    pub fn sdk(&self) -> String {
        format!(
            "{} {}",
            self.report["sdk"].as_str().unwrap_or("?"),
            self.report["sdkVersion"].as_str().unwrap_or("?")
        )
    }
}
