//! One gateway as a user runs it: etcd, toolgate-xds and an Envoy with the toolgate filter,
//! with the operations tests need (policies, overrides, waiting for Envoy to route or for the
//! filter to have a configuration).

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::Value;

use crate::envoy::Envoy;
use crate::etcd::Etcd;
use crate::paths::free_port;
use crate::process::Proc;
use crate::servers::{Member, Registrant, ServerCommand};
use crate::testenv::TestEnv;
use crate::wait::wait_until;
use crate::xds::Xds;

/// The admin token of every [`Stack`]'s toolgate-xds.
pub const ADMIN_TOKEN: &str = "test-admin-token";

/// How a [`Stack`] is started.
#[derive(Clone, Debug)]
pub struct Options {
    /// Envoy worker threads.
    pub concurrency: u32,
    /// Extra `toolgate-xds serve` flags.
    pub xds_args: Vec<String>,
    /// Extra `toolgate-xds bootstrap` flags.
    pub bootstrap_args: Vec<String>,
    /// Whether Envoy runs the toolgate filter.
    pub filter: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            concurrency: 1,
            xds_args: Vec::new(),
            bootstrap_args: Vec::new(),
            filter: true,
        }
    }
}

impl Options {
    pub fn concurrency(mut self, n: u32) -> Self {
        self.concurrency = n;
        self
    }

    pub fn xds_arg(mut self, args: &[&str]) -> Self {
        self.xds_args.extend(args.iter().map(|s| s.to_string()));
        self
    }

    pub fn bootstrap_arg(mut self, args: &[&str]) -> Self {
        self.bootstrap_args
            .extend(args.iter().map(|s| s.to_string()));
        self
    }

    pub fn without_filter(mut self) -> Self {
        self.filter = false;
        self
    }
}

pub struct Stack {
    pub etcd: Etcd,
    pub xds: Xds,
    pub envoy: Envoy,
}

impl Stack {
    /// A gateway with the filter and one Envoy worker.
    pub async fn start(env: &TestEnv) -> Stack {
        Self::with(env, Options::default()).await
    }

    pub async fn with(env: &TestEnv, options: Options) -> Stack {
        let etcd = Etcd::start(env).await;
        let mut xds_args: Vec<&str> = vec!["--admin-token-env", "TOOLGATE_TEST_ADMIN_TOKEN"];
        xds_args.extend(options.xds_args.iter().map(String::as_str));
        let xds = Xds::start_with_env(
            env,
            "xds",
            &etcd.endpoint(),
            &xds_args,
            &[("TOOLGATE_TEST_ADMIN_TOKEN", ADMIN_TOKEN)],
        )
        .await;
        let bootstrap: Vec<&str> = options.bootstrap_args.iter().map(String::as_str).collect();
        let envoy = if options.filter {
            Envoy::start_with_filter(env, "envoy", &xds, options.concurrency, &bootstrap).await
        } else {
            Envoy::start_with(env, "envoy", &xds, options.concurrency, &bootstrap).await
        };
        Stack { etcd, xds, envoy }
    }

    /// The gateway URL of a service.
    pub fn url(&self, service: &str) -> String {
        self.envoy.url(service)
    }

    /// `http://127.0.0.1:<port>`: the gateway's public base URL (the `resource` of its auth
    /// configuration).
    pub fn base_url(&self) -> String {
        self.url("x").trim_end_matches("/mcp/x").to_string()
    }

    /// The aggregate endpoint, `/mcp`, of this stack's Envoy.
    pub fn aggregate_url(&self) -> String {
        format!("{}/mcp", self.base_url())
    }

    /// `method` on toolgate-xds's admin API at `path`, with the admin token and `body` as JSON
    /// when given: the status and the JSON answer (`Null` when it is not JSON).
    pub async fn admin(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
    ) -> (StatusCode, Value) {
        let mut req = reqwest::Client::new()
            .request(method, format!("{}{path}", self.xds.admin_url()))
            .bearer_auth(ADMIN_TOKEN);
        if let Some(body) = body {
            req = req.json(body);
        }
        let resp = req.send().await.expect("admin API");
        let status = resp.status();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    /// PUTs `body` at `path` on toolgate-xds's admin API, which must accept it (panics with
    /// the status and the answer when it does not).
    pub async fn admin_put(&self, path: &str, body: &Value) {
        let resp = reqwest::Client::new()
            .put(format!("{}{path}", self.xds.admin_url()))
            .bearer_auth(ADMIN_TOKEN)
            .json(body)
            .send()
            .await
            .expect("admin API");
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        assert!(status.is_success(), "PUT {path}: {status} {text}");
    }

    /// The reference everything-server (see [`ServerCommand::everything`]) registered as
    /// `service`, instance `<service>-1` probed over MCP, once toolgate-xds has it UP: the
    /// server and its registrar. `tools` are the ones it registers (`--tools`); `None` has its
    /// tools discovered, so `/mcp` lists all it lists (to a client that can answer its
    /// questions).
    pub async fn everything(
        &self,
        env: &TestEnv,
        service: &str,
        tools: Option<&str>,
    ) -> (Proc, Proc) {
        let cmd = ServerCommand::everything(free_port());
        let server = cmd.spawn(env, service);
        let instance = format!("{service}-1");
        let mut registrant = Registrant::new(&self.etcd.endpoint(), service, &cmd.endpoint())
            .arg("--instance-id", &instance)
            .arg("--probe", "mcp");
        if let Some(tools) = tools {
            registrant = registrant.arg("--tools", tools);
        }
        let registrar = registrant.spawn(env, &format!("{service}.registrar"));
        self.wait_state(service, &instance, "UP", Duration::from_secs(30))
            .await;
        (server, registrar)
    }

    /// `orders` on one official Python SDK server (`orders-1`, stateless, answering in JSON;
    /// its lenient JSON reading runs whatever gets through), registered with `ttl` and routed
    /// by Envoy.
    pub async fn python_orders(&self, env: &TestEnv, ttl: u32) -> Member {
        let member = Member::python(
            env,
            &self.etcd.endpoint(),
            "orders",
            "orders-1",
            &["--stateless", "--json-response"],
            ttl,
        )
        .await;
        self.routes("orders", &[&member]).await;
        member
    }

    /// Puts a breaker policy (`key`: `<service>` or `<service>/<tool>`) into etcd and waits
    /// until Envoy's filter has it.
    pub async fn policy(&self, key: &str, policy: Value) {
        self.put(&format!("/mcp/policies/{key}"), &policy.to_string())
            .await;
        let (service, tool) = key.split_once('/').unwrap_or((key, ""));
        self.wait_filter_config(&format!("policy {key}"), |c| {
            let entry = &c["services"][service];
            let applied = if tool.is_empty() {
                &entry["policy"]
            } else {
                &entry["tools"][tool]
            };
            policy
                .as_object()
                .is_some_and(|p| p.iter().all(|(k, v)| &applied[k] == v))
        })
        .await;
    }

    /// Forces a tool open (or closed) through etcd, as the admin API does, and waits until
    /// Envoy's filter has it.
    pub async fn force(&self, service: &str, tool: &str, mode: &str, reason: &str) {
        let value = serde_json::json!({"mode": mode, "reason": reason, "author": "test"});
        self.put(
            &format!("/mcp/overrides/{service}/{tool}"),
            &value.to_string(),
        )
        .await;
        self.wait_filter_config(&format!("override {service}/{tool}"), |c| {
            c["overrides"][service][tool]["mode"] == mode
        })
        .await;
    }

    pub async fn put(&self, key: &str, value: &str) {
        let mut c = self.etcd.client().await;
        c.put(key, value, None).await.expect("etcd put");
    }

    /// Waits until Envoy routes `service` to exactly `members`, and the filter knows the
    /// service's tools.
    pub async fn routes(&self, service: &str, members: &[&Member]) {
        let want: Vec<String> = members.iter().map(|m| m.server.endpoint()).collect();
        self.envoy
            .wait_addresses(service, &want, Duration::from_secs(20))
            .await;
        if !members.is_empty() {
            self.wait_filter_config(&format!("the catalog has {service}"), |c| {
                c["catalog"].get(service).is_some()
            })
            .await;
        }
    }

    /// Endpoints Envoy sends new calls to (EDS health HEALTHY), sorted.
    pub async fn healthy(&self, service: &str) -> Vec<String> {
        let mut v: Vec<String> = self
            .envoy
            .hosts()
            .await
            .remove(service)
            .unwrap_or_default()
            .into_iter()
            .filter(|h| h.health == "HEALTHY")
            .map(|h| h.address)
            .collect();
        v.sort();
        v
    }

    /// Waits until Envoy sends new calls for `service` to exactly `members` (HEALTHY ones).
    pub async fn wait_healthy(&self, service: &str, members: &[&Member], within: Duration) {
        let want: Vec<String> = members.iter().map(|m| m.server.endpoint()).collect();
        self.wait_healthy_addresses(service, &want, within).await;
    }

    /// Waits until Envoy sends new calls for `service` to exactly `addresses` (`ip:port`).
    pub async fn wait_healthy_addresses(
        &self,
        service: &str,
        addresses: &[String],
        within: Duration,
    ) {
        let mut want = addresses.to_vec();
        want.sort();
        wait_until(
            &format!("envoy routes {service} to {want:?}"),
            within,
            || {
                let want = want.clone();
                async move { self.healthy(service).await == want }
            },
        )
        .await;
    }

    /// The instance's entry in toolgate-xds's `/v1/registry` (null when absent).
    pub async fn instance(&self, service: &str, id: &str) -> Value {
        let reg = self.xds.registry().await;
        reg["services"][service]
            .as_array()
            .into_iter()
            .flatten()
            .find(|i| i["instance_id"] == id)
            .cloned()
            .unwrap_or(Value::Null)
    }

    /// The instance's health state in toolgate-xds (`absent` when it has none).
    pub async fn state(&self, service: &str, id: &str) -> String {
        self.instance(service, id).await["state"]
            .as_str()
            .unwrap_or("absent")
            .to_string()
    }

    /// Waits until the instance is in `state`; returns how long that took.
    pub async fn wait_state(
        &self,
        service: &str,
        id: &str,
        state: &str,
        within: Duration,
    ) -> Duration {
        let started = Instant::now();
        wait_until(
            &format!("{service}/{id} is {state}"),
            within,
            || async move { self.state(service, id).await == state },
        )
        .await;
        started.elapsed()
    }

    /// Waits until the filter configuration Envoy applied satisfies `check`.
    pub async fn wait_filter_config(&self, what: &str, check: impl Fn(&Value) -> bool) {
        wait_until(
            &format!("envoy's filter has {what}"),
            Duration::from_secs(20),
            || async { self.envoy.filter_config().await.is_some_and(|c| check(&c)) },
        )
        .await;
    }
}
