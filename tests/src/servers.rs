//! MCP servers (the demo services and the lab server) and their registrars, as processes.

use std::path::PathBuf;
use std::time::Duration;

use serde_json::Value;

use crate::paths::{
    everything_server, free_port, loopback_preload, project_bin, python_bin, workspace_root,
};
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
    /// `@modelcontextprotocol/server-everything`, unmodified: counts nothing.
    Everything,
}

impl McpServer {
    /// `toolgate-lab` with extra flags (see `toolgate-lab --help`), ready when `/control` answers.
    pub async fn lab(env: &TestEnv, instance_id: &str, extra: &[&str]) -> McpServer {
        Self::lab_on(env, instance_id, free_port(), extra).await
    }

    /// [`lab`](Self::lab) on a given port (for a registrar started before its server).
    pub async fn lab_on(env: &TestEnv, instance_id: &str, port: u16, extra: &[&str]) -> McpServer {
        let proc = ServerCommand::lab(port, instance_id, extra).spawn(env, instance_id);
        Self::ready(proc, port, instance_id, "/control", Kind::Rust).await
    }

    /// `tests/python/server.py`: an MCP server built with the official Python SDK, whose lenient
    /// JSON reading (duplicate keys, NaN) executes whatever the gateway lets through. `extra`:
    /// `--stateless`, `--json-response`, `--no-health`.
    pub async fn python(env: &TestEnv, instance_id: &str, extra: &[&str]) -> McpServer {
        let port = free_port();
        let proc = ServerCommand::python(port, extra).spawn(env, instance_id);
        // `/calls`, not `/health`: it is there with --no-health too.
        Self::ready(proc, port, instance_id, "/calls", Kind::Python).await
    }

    /// `@modelcontextprotocol/server-everything` in Streamable HTTP mode, unmodified (kept on
    /// 127.0.0.1 by [`ServerCommand::everything`]); it has no `/health` and counts no calls.
    pub async fn everything(env: &TestEnv, instance_id: &str) -> McpServer {
        let port = free_port();
        let proc = ServerCommand::everything(port).spawn(env, instance_id);
        Self::ready(proc, port, instance_id, "", Kind::Everything).await
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
        // An empty path: the server has no route a GET succeeds on, so any HTTP answer
        // (a 404 for `/`) shows it listens.
        let any_answer = path.is_empty();
        wait_until(
            &format!("{instance_id} answers GET {url}"),
            Duration::from_secs(20),
            || async {
                matches!(server.http.get(&url).send().await,
                    Ok(r) if any_answer || r.status().is_success())
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

    /// Zeroes the lab's counts (`POST /control/reset-counters`), returning the new state.
    pub async fn reset_counters(&self) -> Value {
        self.http
            .post(format!("{}/control/reset-counters", self.base_url()))
            .send()
            .await
            .expect("POST /control/reset-counters")
            .json()
            .await
            .expect("/control JSON")
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
            Kind::Everything => panic!(
                "{} (the everything-server) does not count tool calls",
                self.instance_id
            ),
        }
    }
}

/// How to start an MCP server on a given loopback port: program, arguments and environment.
/// A test runs it itself ([`spawn`](Self::spawn)) or has `toolgate-register` run it as its
/// child ([`Registrant::server`]).
#[derive(Debug, Clone)]
pub struct ServerCommand {
    pub program: PathBuf,
    pub args: Vec<String>,
    /// Set on top of the inherited environment (for a registrar's child: on the registrar,
    /// whose environment the child inherits).
    pub env: Vec<(String, String)>,
    pub port: u16,
}

impl ServerCommand {
    /// `toolgate-lab --listen 127.0.0.1:<port> --instance-id <id> <extra>` (see
    /// `toolgate-lab --help`; `--no-health` leaves `/health` out).
    pub fn lab(port: u16, instance_id: &str, extra: &[&str]) -> ServerCommand {
        let mut args = vec![
            "--listen".to_string(),
            format!("127.0.0.1:{port}"),
            "--instance-id".to_string(),
            instance_id.to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        ServerCommand {
            program: project_bin("toolgate-lab"),
            args,
            env: Vec::new(),
            port,
        }
    }

    /// `.venv/bin/python tests/python/server.py <port> <extra>`; `extra`: `--stateless`,
    /// `--json-response`, `--no-health`. It binds 127.0.0.1 itself.
    pub fn python(port: u16, extra: &[&str]) -> ServerCommand {
        let mut args = vec![
            workspace_root()
                .join("tests/python/server.py")
                .display()
                .to_string(),
            port.to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        ServerCommand {
            program: python_bin(),
            args,
            env: Vec::new(),
            port,
        }
    }

    /// `PORT=<port> node --import tests/node/loopback.mjs <everything-server> streamableHttp`:
    /// the reference server as published. It reads its port from `PORT` only and binds every
    /// interface; the preload keeps it on 127.0.0.1. MCP at `/mcp`, no `/health`.
    pub fn everything(port: u16) -> ServerCommand {
        ServerCommand {
            program: PathBuf::from("node"),
            args: vec![
                "--import".to_string(),
                loopback_preload().display().to_string(),
                everything_server().display().to_string(),
                "streamableHttp".to_string(),
            ],
            env: vec![("PORT".to_string(), port.to_string())],
            port,
        }
    }

    /// `127.0.0.1:<port>`, as registered in etcd.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn mcp_url(&self) -> String {
        format!("http://127.0.0.1:{}/mcp", self.port)
    }

    /// Starts the server as the test's own child; output goes to `<name>.log`.
    pub fn spawn(&self, env: &TestEnv, name: &str) -> Proc {
        env.spawn_with_env(name, &self.program, &self.args, &self.env)
    }
}

/// Arguments for `toolgate-register`, built up by a test.
#[derive(Debug, Clone)]
pub struct Registrant {
    args: Vec<String>,
    child: Vec<String>,
    env: Vec<(String, String)>,
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
            env: Vec::new(),
        }
    }

    /// `toolgate-register --etcd <etcd> --service <service> --stdio`: the registrar bridges a
    /// stdio server (the child given with [`child`](Self::child)) and registers the endpoint
    /// it serves.
    pub fn stdio(etcd: &str, service: &str) -> Registrant {
        Registrant {
            args: vec![
                "--etcd".into(),
                etcd.into(),
                "--service".into(),
                service.into(),
                "--stdio".into(),
            ],
            child: Vec::new(),
            env: Vec::new(),
        }
    }

    /// A flag without a value (`--shared`).
    pub fn flag(mut self, flag: &str) -> Self {
        self.args.push(flag.into());
        self
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

    /// Sets `key=value` in the registrar's environment, which its child inherits (the
    /// everything-server takes its port only from `PORT`).
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// Runs `server` as the registrar's child: its command line and its environment.
    pub fn server(self, server: &ServerCommand) -> Self {
        let with_child = self.child(&server.program, &server.args);
        server
            .env
            .iter()
            .fold(with_child, |registrant, (key, value)| {
                registrant.env(key, value)
            })
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
        let mut envs = vec![("RUST_LOG".to_string(), "info".to_string())];
        envs.extend(self.env.iter().cloned());
        env.spawn_with_env(name, &project_bin("toolgate-register"), &self.args(), &envs)
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

    /// [`start`](Self::start) with a registrar that does not watch its server
    /// (`--watch-interval 0`): a killed server stays registered, its lease alive, until
    /// toolgate's probes find it (a registrar that cannot see its server, or a hung server
    /// that registers itself, looks like this).
    pub async fn start_unwatched(
        env: &TestEnv,
        etcd: &str,
        service: &str,
        instance_id: &str,
        lab_args: &[&str],
        ttl: u32,
    ) -> Member {
        let tools = "read_order,write_order,echo";
        let mut args = vec!["--tools", tools];
        args.extend_from_slice(lab_args);
        let server = McpServer::lab(env, instance_id, &args).await;
        Self::register_with(
            env,
            etcd,
            service,
            server,
            tools,
            ttl,
            &["--watch-interval", "0"],
        )
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
    /// registered with its four tools, and `report_links` with `--links`, `ask_colour` with
    /// `--mrtr`.
    pub async fn python(
        env: &TestEnv,
        etcd: &str,
        service: &str,
        instance_id: &str,
        extra: &[&str],
        ttl: u32,
    ) -> Member {
        let server = McpServer::python(env, instance_id, extra).await;
        let mut tools = "read_order,write_order,fail_order,slow_order".to_string();
        if extra.contains(&"--links") {
            tools.push_str(",report_links");
        }
        if extra.contains(&"--mrtr") {
            tools.push_str(",ask_colour");
        }
        Self::register(env, etcd, service, server, &tools, ttl)
    }

    fn register(
        env: &TestEnv,
        etcd: &str,
        service: &str,
        server: McpServer,
        tools: &str,
        ttl: u32,
    ) -> Member {
        Self::register_with(env, etcd, service, server, tools, ttl, &[])
    }

    fn register_with(
        env: &TestEnv,
        etcd: &str,
        service: &str,
        server: McpServer,
        tools: &str,
        ttl: u32,
        registrar_extra: &[&str],
    ) -> Member {
        let instance_id = server.instance_id.clone();
        let mut registrant = Registrant::new(etcd, service, &server.endpoint())
            .arg("--instance-id", &instance_id)
            .arg("--tools", tools)
            .arg("--ttl", &ttl.to_string());
        for pair in registrar_extra.chunks(2) {
            if let [flag, value] = pair {
                registrant = registrant.arg(flag, value);
            }
        }
        let registrar = registrant.spawn(env, &format!("{instance_id}.registrar"));
        Member {
            server,
            registrar,
            key: format!("/mcp/services/{service}/{instance_id}"),
        }
    }
}
