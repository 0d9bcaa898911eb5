//! One gateway as a user runs it: etcd, toolgate-xds and an Envoy with the toolgate filter,
//! with the operations tests need (policies, overrides, waiting for Envoy to route or for the
//! filter to have a configuration).

use std::time::{Duration, Instant};

use serde_json::Value;

use crate::envoy::Envoy;
use crate::etcd::Etcd;
use crate::servers::Member;
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

    /// The aggregate endpoint, `/mcp`, of this stack's Envoy.
    pub fn aggregate_url(&self) -> String {
        let service_url = self.url("x");
        format!("{}/mcp", service_url.trim_end_matches("/mcp/x"))
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
