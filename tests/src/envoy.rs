//! A real Envoy configured by the bootstrap that `toolgate-xds bootstrap` prints.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::Value;

use crate::paths::{free_port, project_bin, tool_bin};
use crate::process::Proc;
use crate::testenv::TestEnv;
use crate::wait::wait_until;
use crate::xds::Xds;

/// `--drain-time-s`: how long an Envoy drains its connections before a hot restart's parent
/// stops answering on them (tests keep it short; Envoy's default is 600 s).
pub const DRAIN_TIME: Duration = Duration::from_secs(1);

/// `--parent-shutdown-time-s` for requests of up to `longest_request`: the drain, then one
/// more request started as it ends, then a margin for a loaded machine, in whole seconds.
fn parent_shutdown_time(longest_request: Duration) -> Duration {
    let total = DRAIN_TIME + longest_request + Duration::from_secs(2);
    Duration::from_secs(total.as_secs() + u64::from(total.subsec_nanos() > 0))
}

/// The ADS protocol (`delta` or `sotw`) every Envoy a test starts speaks, when set; else
/// `toolgate-xds bootstrap`'s default.
pub const XDS_PROTOCOL_ENV: &str = "TOOLGATE_TEST_XDS_PROTOCOL";

pub struct Envoy {
    pub name: String,
    pub port: u16,
    pub admin_port: u16,
    bootstrap: std::path::PathBuf,
    concurrency: u32,
    /// Hot restart epoch of the running process (0 until [`hot_restart`](Self::hot_restart)).
    epoch: u32,
    pub proc: Option<Proc>,
    /// `--parent-shutdown-time-s` of the next hot restart.
    parent_shutdown: Duration,
    http: reqwest::Client,
}

/// One endpoint as Envoy's admin `/clusters` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvoyHost {
    pub address: String,
    pub health: String,
    pub weight: u64,
}

impl Envoy {
    /// Starts Envoy with `--concurrency 1`; ready when its admin says LIVE.
    pub async fn start(env: &TestEnv, name: &str, xds: &Xds) -> Envoy {
        Self::start_with(env, name, xds, 1, &[]).await
    }

    /// `bootstrap_extra` is passed to `toolgate-xds bootstrap` (e.g. `--filter path.wasm`).
    pub async fn start_with(
        env: &TestEnv,
        name: &str,
        xds: &Xds,
        concurrency: u32,
        bootstrap_extra: &[&str],
    ) -> Envoy {
        Self::start_inner(env, name, xds, concurrency, bootstrap_extra, true).await
    }

    /// [`start_with`](Self::start_with) with the toolgate wasm filter (built by `make build`);
    /// `bootstrap_extra` adds further `toolgate-xds bootstrap` flags.
    pub async fn start_with_filter(
        env: &TestEnv,
        name: &str,
        xds: &Xds,
        concurrency: u32,
        bootstrap_extra: &[&str],
    ) -> Envoy {
        let wasm = crate::paths::filter_wasm();
        let wasm = wasm.to_string_lossy();
        let mut extra = vec!["--filter", wasm.as_ref()];
        extra.extend_from_slice(bootstrap_extra);
        Self::start_with(env, name, xds, concurrency, &extra).await
    }

    /// Like [`start_with`](Self::start_with), but only waits for the admin listener: for an
    /// Envoy that is expected never to get its configuration (and so never to be LIVE).
    pub async fn start_unconfigured(
        env: &TestEnv,
        name: &str,
        xds: &Xds,
        bootstrap_extra: &[&str],
    ) -> Envoy {
        Self::start_inner(env, name, xds, 1, bootstrap_extra, false).await
    }

    /// What Envoy's `/ready` says (`LIVE`, `PRE_INITIALIZING`, ...), empty if it does not answer.
    pub async fn readiness(&self) -> String {
        match self
            .http
            .get(format!("{}/ready", self.admin_url()))
            .send()
            .await
        {
            Ok(r) => r.text().await.unwrap_or_default().trim().to_string(),
            Err(_) => String::new(),
        }
    }

    async fn start_inner(
        env: &TestEnv,
        name: &str,
        xds: &Xds,
        concurrency: u32,
        bootstrap_extra: &[&str],
        wait_live: bool,
    ) -> Envoy {
        let (port, admin_port) = (free_port(), free_port());
        let mut args: Vec<String> = vec![
            "bootstrap".into(),
            "--node-id".into(),
            name.into(),
            "--listen".into(),
            format!("127.0.0.1:{port}"),
            "--xds".into(),
            xds.xds_addr(),
            "--admin".into(),
            format!("127.0.0.1:{admin_port}"),
        ];
        args.extend(bootstrap_extra.iter().map(|s| s.to_string()));
        // `make test` runs the suites that exercise discovery a second time under the other
        // ADS protocol; a test that names one itself keeps it.
        if let Ok(protocol) = std::env::var(XDS_PROTOCOL_ENV) {
            if !args.iter().any(|a| a == "--xds-protocol") {
                args.extend(["--xds-protocol".into(), protocol]);
            }
        }
        let out = std::process::Command::new(project_bin("toolgate-xds"))
            .args(&args)
            .output()
            .expect("running toolgate-xds bootstrap");
        assert!(
            out.status.success(),
            "toolgate-xds bootstrap failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let bootstrap = env.path(&format!("{name}.bootstrap.json"));
        std::fs::write(&bootstrap, &out.stdout).expect("writing the bootstrap");
        let mut envoy = Envoy {
            name: name.to_string(),
            port,
            admin_port,
            bootstrap,
            concurrency,
            epoch: 0,
            proc: None,
            parent_shutdown: Duration::ZERO,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .no_proxy()
                .build()
                .expect("http client"),
        };
        if wait_live {
            envoy.launch(env).await;
        } else {
            envoy.spawn(env);
            wait_until(
                &format!("envoy {} admin answers", envoy.name),
                Duration::from_secs(30),
                || async { !envoy.readiness().await.is_empty() },
            )
            .await;
        }
        envoy
    }

    fn base_id_path(&self) -> std::path::PathBuf {
        self.bootstrap.with_extension("base-id")
    }

    fn spawn(&mut self, env: &TestEnv) {
        let mut args: Vec<String> = vec![
            "-c".into(),
            self.bootstrap.to_string_lossy().into_owned(),
            "--concurrency".into(),
            self.concurrency.to_string(),
            "--log-level".into(),
            "info".into(),
            "--drain-time-s".into(),
            DRAIN_TIME.as_secs().to_string(),
        ];
        if self.epoch == 0 {
            // Several Envoys per machine (parallel tests) need distinct shared-memory ids; the
            // one picked is written down for a hot restart, which must use the same.
            args.extend([
                "--use-dynamic-base-id".into(),
                "--base-id-path".into(),
                self.base_id_path().to_string_lossy().into_owned(),
            ]);
        } else {
            let base_id = std::fs::read_to_string(self.base_id_path())
                .expect("the base id the first epoch wrote");
            args.extend([
                "--base-id".into(),
                base_id.trim().to_string(),
                "--restart-epoch".into(),
                self.epoch.to_string(),
                "--parent-shutdown-time-s".into(),
                self.parent_shutdown.as_secs().to_string(),
            ]);
        }
        let name = match self.epoch {
            0 => self.name.clone(),
            n => format!("{}.epoch{n}", self.name),
        };
        self.proc = Some(env.spawn(&name, &tool_bin("envoy"), &args));
    }

    /// A hot restart: a process of the next epoch takes the listening sockets over from the
    /// running one, which drains for [`DRAIN_TIME`] and is then shut down.
    ///
    /// `longest_request` is the longest a request may run (the route timeout): the parent is
    /// killed `--parent-shutdown-time-s` after the restart, with whatever it is still serving.
    /// Draining only closes an HTTP/1 connection after its next response, so a keep-alive
    /// client may start one more request on the parent as the drain ends, and that request
    /// must finish before the parent goes. Returns once the parent has exited and the new
    /// process answers the admin API (which the parent serves until it exits) as LIVE.
    pub async fn hot_restart(&mut self, env: &TestEnv, longest_request: Duration) {
        let parent = self.proc.take();
        self.epoch += 1;
        self.parent_shutdown = parent_shutdown_time(longest_request);
        self.spawn(env);
        if let Some(mut parent) = parent {
            let exited = parent
                .wait_exit(self.parent_shutdown + Duration::from_secs(10))
                .await;
            assert!(
                exited.is_some(),
                "envoy {} epoch {} did not exit {:?} after its hot restart",
                self.name,
                self.epoch - 1,
                self.parent_shutdown
            );
        }
        let url = format!("{}/server_info", self.admin_url());
        let http = self.http.clone();
        let epoch = self.epoch;
        wait_until(
            &format!("envoy {} epoch {epoch} is LIVE", self.name),
            Duration::from_secs(30),
            || {
                let (http, url) = (http.clone(), url.clone());
                async move {
                    let Ok(r) = http.get(&url).send().await else {
                        return false;
                    };
                    let v: Value = r.json().await.unwrap_or_default();
                    v["state"] == "LIVE"
                        && v["command_line_options"]["restart_epoch"].as_u64()
                            == Some(u64::from(epoch))
                }
            },
        )
        .await;
    }

    /// How long the parent of the last hot restart was given before it was shut down.
    pub fn parent_shutdown(&self) -> Duration {
        self.parent_shutdown
    }

    /// The hot restart epoch of the running process.
    pub fn epoch(&self) -> u32 {
        self.epoch
    }

    async fn launch(&mut self, env: &TestEnv) {
        self.spawn(env);
        let url = format!("{}/ready", self.admin_url());
        let http = self.http.clone();
        wait_until(
            &format!("envoy {} is LIVE", self.name),
            Duration::from_secs(30),
            || {
                let http = http.clone();
                let url = url.clone();
                async move {
                    match http.get(&url).send().await {
                        Ok(r) => r.text().await.is_ok_and(|t| t.trim() == "LIVE"),
                        Err(_) => false,
                    }
                }
            },
        )
        .await;
    }

    pub fn admin_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.admin_port)
    }

    /// The gateway URL of one service: `http://127.0.0.1:<port>/mcp/<service>`.
    pub fn url(&self, service: &str) -> String {
        format!("http://127.0.0.1:{}/mcp/{service}", self.port)
    }

    pub fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }

    /// Stops Envoy and starts it again (not a hot restart: connections are lost).
    pub async fn restart(&mut self, env: &TestEnv) {
        if let Some(mut p) = self.proc.take() {
            p.stop(Duration::from_secs(5)).await;
        }
        self.epoch = 0;
        self.launch(env).await;
    }

    /// Endpoints per cluster from admin `/clusters?format=json` (clusters `mcp.<service>` only).
    pub async fn hosts(&self) -> BTreeMap<String, Vec<EnvoyHost>> {
        self.admin().hosts().await
    }

    /// A handle on the admin API that can move into a task.
    pub fn admin(&self) -> AdminView {
        AdminView::new(self.admin_url())
    }

    /// The sorted addresses of `service`'s endpoints in Envoy.
    pub async fn addresses(&self, service: &str) -> Vec<String> {
        let mut v: Vec<String> = self
            .hosts()
            .await
            .remove(service)
            .unwrap_or_default()
            .into_iter()
            .map(|h| h.address)
            .collect();
        v.sort();
        v
    }

    /// Waits until Envoy has exactly `want` (in any order) for `service`; returns how long
    /// that took.
    pub async fn wait_addresses(
        &self,
        service: &str,
        want: &[String],
        within: Duration,
    ) -> Duration {
        let mut want = want.to_vec();
        want.sort();
        wait_until(
            &format!("{} has exactly {want:?} for {service}", self.name),
            within,
            || {
                let want = want.clone();
                async move { self.addresses(service).await == want }
            },
        )
        .await
    }

    /// Envoy's own stat (admin `/stats?filter=`), summed.
    pub async fn stat(&self, name: &str) -> u64 {
        self.admin().stat(name).await
    }

    /// Connections each worker thread of the gateway listener accepted so far
    /// (`listener.<address>.worker_<n>.downstream_cx_total`), by worker.
    pub async fn workers_with_connections(&self) -> Vec<u64> {
        let text = match self
            .http
            .get(format!(
                "{}/stats?filter=^listener\\..*\\.worker_[0-9]+\\.downstream_cx_total$",
                self.admin_url()
            ))
            .send()
            .await
        {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        let mut workers: BTreeMap<u32, u64> = BTreeMap::new();
        for line in text.lines() {
            let Some((name, value)) = line.rsplit_once(": ") else {
                continue;
            };
            // Only the gateway's own listener (not the admin's).
            if !name.contains(&format!("_{}.worker_", self.port)) {
                continue;
            }
            let worker = name
                .rsplit_once(".worker_")
                .and_then(|(_, rest)| rest.split('.').next()?.parse::<u32>().ok());
            if let (Some(worker), Ok(value)) = (worker, value.trim().parse::<u64>()) {
                *workers.entry(worker).or_default() += value;
            }
        }
        workers.into_values().collect()
    }

    /// Envoy's stats in Prometheus text (`/stats/prometheus`).
    pub async fn prometheus(&self) -> String {
        match self
            .http
            .get(format!("{}/stats/prometheus", self.admin_url()))
            .send()
            .await
        {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        }
    }

    /// The value of a toolgate filter stat for one tool (`toolgate_state`, `toolgate_calls`…),
    /// `None` if the filter never defined it.
    pub async fn tool_stat(&self, name: &str, service: &str, tool: &str) -> Option<f64> {
        let prom = self.prometheus().await;
        let (service, tool) = (format!("service=\"{service}\""), format!("tool=\"{tool}\""));
        prom.lines().find_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (metric, labels) = series.split_once('{')?;
            (metric == name && labels.contains(&service) && labels.contains(&tool))
                .then(|| value.parse::<f64>().ok())?
        })
    }

    /// The toolgate filter's plugin configuration as this Envoy applied it over ECDS (from
    /// `/config_dump`), `None` before it has one.
    pub async fn filter_config(&self) -> Option<Value> {
        let dump: Value = self
            .http
            .get(format!(
                "{}/config_dump?resource=ecds_filters",
                self.admin_url()
            ))
            .send()
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        // configs[].ecds_filter.typed_config (Wasm).config.configuration.value: the JSON.
        dump["configs"].as_array()?.iter().find_map(|c| {
            let text =
                c["ecds_filter"]["typed_config"]["config"]["configuration"]["value"].as_str()?;
            serde_json::from_str(text).ok()
        })
    }
}

fn regex_escape(s: &str) -> String {
    s.replace('.', "\\.")
}

/// Envoy's admin API, detached from the process handle.
#[derive(Clone)]
pub struct AdminView {
    url: String,
    http: reqwest::Client,
}

impl AdminView {
    pub fn new(url: String) -> AdminView {
        AdminView {
            url,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .no_proxy()
                .build()
                .expect("http client"),
        }
    }

    pub async fn hosts(&self) -> BTreeMap<String, Vec<EnvoyHost>> {
        self.try_hosts().await.unwrap_or_default()
    }

    /// Like [`hosts`](Self::hosts), but `None` when Envoy does not answer.
    pub async fn try_hosts(&self) -> Option<BTreeMap<String, Vec<EnvoyHost>>> {
        let resp = self
            .http
            .get(format!("{}/clusters?format=json", self.url))
            .send()
            .await
            .ok()?;
        if !resp.status().is_success() {
            return None;
        }
        let v = resp.json::<Value>().await.ok()?;
        let mut out = BTreeMap::new();
        for c in v["cluster_statuses"].as_array().into_iter().flatten() {
            let name = c["name"].as_str().unwrap_or_default();
            let Some(service) = name.strip_prefix("mcp.") else {
                continue;
            };
            let hosts = c["host_statuses"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|h| EnvoyHost {
                    address: format!(
                        "{}:{}",
                        h["address"]["socket_address"]["address"]
                            .as_str()
                            .unwrap_or(""),
                        h["address"]["socket_address"]["port_value"]
                            .as_u64()
                            .unwrap_or(0)
                    ),
                    health: h["health_status"]["eds_health_status"]
                        .as_str()
                        .unwrap_or("HEALTHY")
                        .to_string(),
                    weight: h["weight"].as_u64().unwrap_or(1),
                })
                .collect();
            out.insert(service.to_string(), hosts);
        }
        Some(out)
    }

    /// Envoy's own stat (admin `/stats?filter=`), summed; 0 when Envoy does not answer.
    /// Cheap next to [`hosts`](Self::hosts) with thousands of endpoints.
    pub async fn stat(&self, name: &str) -> u64 {
        let Ok(resp) = self
            .http
            .get(format!(
                "{}/stats?filter=^{}$",
                self.url,
                regex_escape(name)
            ))
            .send()
            .await
        else {
            return 0;
        };
        resp.text()
            .await
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.rsplit_once(": ")?.1.trim().parse::<u64>().ok())
            .sum()
    }

    /// Envoy's heap in use now (tcmalloc's allocated bytes, admin `/memory`); its stat
    /// `server.memory_allocated` is only as fresh as the last stats flush. 0 when Envoy does
    /// not answer.
    pub async fn heap_allocated(&self) -> u64 {
        let Ok(resp) = self.http.get(format!("{}/memory", self.url)).send().await else {
            return 0;
        };
        let v: Value = resp.json().await.unwrap_or_default();
        // Envoy prints the 64-bit numbers as strings.
        v["allocated"]
            .as_str()
            .and_then(|a| a.parse().ok())
            .or_else(|| v["allocated"].as_u64())
            .unwrap_or(0)
    }

    /// How many endpoints Envoy has for `service`.
    pub async fn count(&self, service: &str) -> usize {
        self.hosts().await.get(service).map_or(0, Vec::len)
    }
}
