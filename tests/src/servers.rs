//! MCP servers (the demo services and the lab server) and their registrars, as processes.

use std::time::Duration;

use serde_json::Value;

use crate::paths::{free_port, project_bin};
use crate::process::Proc;
use crate::testenv::TestEnv;
use crate::wait::wait_until;

/// A running `toolgate-lab` or `toolgate-demo` on a free loopback port.
pub struct McpServer {
    pub proc: Proc,
    pub port: u16,
    pub instance_id: String,
    kind: Kind,
    http: reqwest::Client,
}

/// Which program serves, which decides where its call counts are read.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `toolgate-lab` or `toolgate-demo`: counts under `GET /control`.
    Rust,
    /// `tests/python/server.py`, the official Python SDK: counts at `GET /calls`.
    Python,
}

impl McpServer {
    /// `toolgate-lab` with extra flags (see `toolgate-lab --help`), ready when `/control` answers.
    pub async fn lab(env: &TestEnv, instance_id: &str, extra: &[&str]) -> McpServer {
        Self::lab_on(env, instance_id, free_port(), extra).await
    }

    /// [`lab`](Self::lab) on a given port (for a registrar started before its server).
    pub async fn lab_on(env: &TestEnv, instance_id: &str, port: u16, extra: &[&str]) -> McpServer {
        let mut args = vec![
            "--listen".to_string(),
            format!("127.0.0.1:{port}"),
            "--instance-id".to_string(),
            instance_id.to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let proc = env.spawn(instance_id, &project_bin("toolgate-lab"), &args);
        Self::ready(proc, port, instance_id, "/control", Kind::Rust).await
    }

    /// `tests/python/server.py`: an MCP server built with the official Python SDK, whose lenient
    /// JSON reading (duplicate keys, NaN) executes whatever the gateway lets through. `extra`:
    /// `--stateless`, `--json-response`.
    pub async fn python(env: &TestEnv, instance_id: &str, extra: &[&str]) -> McpServer {
        let port = free_port();
        let mut args = vec![
            crate::paths::workspace_root()
                .join("tests/python/server.py")
                .display()
                .to_string(),
            port.to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let python = crate::paths::workspace_root().join(".venv/bin/python");
        let proc = env.spawn(instance_id, &python, &args);
        Self::ready(proc, port, instance_id, "/health", Kind::Python).await
    }

    /// `toolgate-demo --service <service>`, ready when `/health` answers.
    pub async fn demo(env: &TestEnv, service: &str, instance_id: &str) -> McpServer {
        let port = free_port();
        let args = vec![
            "--service".to_string(),
            service.to_string(),
            "--listen".to_string(),
            format!("127.0.0.1:{port}"),
            "--instance-id".to_string(),
            instance_id.to_string(),
        ];
        let proc = env.spawn(instance_id, &project_bin("toolgate-demo"), &args);
        Self::ready(proc, port, instance_id, "/health", Kind::Rust).await
    }

    async fn ready(proc: Proc, port: u16, instance_id: &str, path: &str, kind: Kind) -> McpServer {
        let server = McpServer {
            proc,
            port,
            instance_id: instance_id.to_string(),
            kind,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()
                .expect("http client"),
        };
        let url = format!("{}{path}", server.base_url());
        wait_until(
            &format!("{instance_id} answers {path}"),
            Duration::from_secs(20),
            || async {
                matches!(server.http.get(&url).send().await, Ok(r) if r.status().is_success())
            },
        )
        .await;
        server
    }

    /// `127.0.0.1:<port>`, as registered in etcd.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn base_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn mcp_url(&self) -> String {
        format!("{}/mcp", self.base_url())
    }

    /// The lab's knobs and counters (`GET /control`).
    pub async fn control(&self) -> Value {
        self.http
            .get(format!("{}/control", self.base_url()))
            .send()
            .await
            .expect("GET /control")
            .json()
            .await
            .expect("/control JSON")
    }

    /// Changes the lab's knobs (`POST /control`), returning the new state.
    pub async fn set(&self, knobs: Value) -> Value {
        let resp = self
            .http
            .post(format!("{}/control", self.base_url()))
            .json(&knobs)
            .send()
            .await
            .expect("POST /control");
        assert!(
            resp.status().is_success(),
            "lab rejected knobs {knobs}: {}",
            resp.status()
        );
        resp.json().await.expect("/control JSON")
    }

    /// How many `tools/call` of `tool` the server executed, by its own count.
    pub async fn calls(&self, tool: &str) -> u64 {
        match self.kind {
            Kind::Rust => self.control().await["calls"][tool].as_u64().unwrap_or(0),
            Kind::Python => {
                let counts: Value = self
                    .http
                    .get(format!("{}/calls", self.base_url()))
                    .send()
                    .await
                    .expect("GET /calls")
                    .json()
                    .await
                    .expect("/calls JSON");
                counts[tool].as_u64().unwrap_or(0)
            }
        }
    }
}

/// Arguments for `toolgate-register`, built up by a test.
#[derive(Debug, Clone)]
pub struct Registrant {
    args: Vec<String>,
    child: Vec<String>,
}

impl Registrant {
    pub fn new(etcd: &str, service: &str, endpoint: &str) -> Registrant {
        Registrant {
            args: vec![
                "--etcd".into(),
                etcd.into(),
                "--service".into(),
                service.into(),
                "--endpoint".into(),
                endpoint.into(),
            ],
            child: Vec::new(),
        }
    }

    pub fn arg(mut self, flag: &str, value: &str) -> Self {
        self.args.push(flag.into());
        self.args.push(value.into());
        self
    }

    /// Runs `command` as the registrar's child.
    pub fn child(mut self, program: &std::path::Path, args: &[String]) -> Self {
        self.child = std::iter::once(program.to_string_lossy().into_owned())
            .chain(args.iter().cloned())
            .collect();
        self
    }

    pub fn args(&self) -> Vec<String> {
        let mut all = self.args.clone();
        if !self.child.is_empty() {
            all.push("--".into());
            all.extend(self.child.iter().cloned());
        }
        all
    }

    pub fn spawn(&self, env: &TestEnv, name: &str) -> Proc {
        env.spawn_with_env(
            name,
            &project_bin("toolgate-register"),
            &self.args(),
            &[("RUST_LOG".into(), "info".into())],
        )
    }
}

/// A lab server and the `toolgate-register` that registers it (as separate processes, so a
/// test can kill either).
pub struct Member {
    pub server: McpServer,
    pub registrar: Proc,
    pub key: String,
}

impl Member {
    pub async fn start(
        env: &TestEnv,
        etcd: &str,
        service: &str,
        instance_id: &str,
        lab_args: &[&str],
        ttl: u32,
    ) -> Member {
        Self::start_with_tools(
            env,
            etcd,
            service,
            instance_id,
            lab_args,
            "read_order,write_order,echo",
            ttl,
        )
        .await
    }

    /// [`start`](Self::start) with a lab serving and registering `tools` (comma-separated).
    pub async fn start_with_tools(
        env: &TestEnv,
        etcd: &str,
        service: &str,
        instance_id: &str,
        lab_args: &[&str],
        tools: &str,
        ttl: u32,
    ) -> Member {
        let mut args = vec!["--tools", tools];
        args.extend_from_slice(lab_args);
        let server = McpServer::lab(env, instance_id, &args).await;
        Self::register(env, etcd, service, server, tools, ttl)
    }

    /// The official Python SDK server (`tests/python/server.py`, see [`McpServer::python`]),
    /// registered with its four tools.
    pub async fn python(
        env: &TestEnv,
        etcd: &str,
        service: &str,
        instance_id: &str,
        extra: &[&str],
        ttl: u32,
    ) -> Member {
        let server = McpServer::python(env, instance_id, extra).await;
        let tools = "read_order,write_order,fail_order,slow_order";
        Self::register(env, etcd, service, server, tools, ttl)
    }

    fn register(
        env: &TestEnv,
        etcd: &str,
        service: &str,
        server: McpServer,
        tools: &str,
        ttl: u32,
    ) -> Member {
        let instance_id = server.instance_id.clone();
        let registrar = Registrant::new(etcd, service, &server.endpoint())
            .arg("--instance-id", &instance_id)
            .arg("--tools", tools)
            .arg("--ttl", &ttl.to_string())
            .spawn(env, &format!("{instance_id}.registrar"));
        Member {
            server,
            registrar,
            key: format!("/mcp/services/{service}/{instance_id}"),
        }
    }
}
