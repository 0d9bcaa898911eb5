//! A real toolgate-xds process on free loopback ports.

use std::time::Duration;

use serde_json::Value;

use crate::paths::{free_port, project_bin};
use crate::process::Proc;
use crate::testenv::TestEnv;
use crate::wait::wait_until;

pub struct Xds {
    pub name: String,
    pub xds_port: u16,
    pub admin_port: u16,
    args: Vec<String>,
    envs: Vec<(String, String)>,
    pub proc: Option<Proc>,
    http: reqwest::Client,
}

impl Xds {
    /// Starts `toolgate-xds serve` against `etcd` with a state dir in the test's directory,
    /// plus `extra` flags; ready when `/healthz` answers.
    pub async fn start(env: &TestEnv, name: &str, etcd: &str, extra: &[&str]) -> Xds {
        Self::start_with_env(env, name, etcd, extra, &[]).await
    }

    /// Like [`start`](Self::start), with extra environment variables (failpoints).
    pub async fn start_with_env(
        env: &TestEnv,
        name: &str,
        etcd: &str,
        extra: &[&str],
        envs: &[(&str, &str)],
    ) -> Xds {
        let (xds_port, admin_port) = (free_port(), free_port());
        let mut args: Vec<String> = vec![
            "serve".into(),
            "--etcd".into(),
            etcd.into(),
            "--xds-listen".into(),
            format!("127.0.0.1:{xds_port}"),
            "--admin-listen".into(),
            format!("127.0.0.1:{admin_port}"),
            "--state-dir".into(),
            env.path(&format!("{name}.state"))
                .to_string_lossy()
                .into_owned(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut xds = Xds {
            name: name.to_string(),
            xds_port,
            admin_port,
            args,
            envs: envs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .chain([(
                    "RUST_LOG".to_string(),
                    "info,toolgate_xds=debug".to_string(),
                )])
                .collect(),
            proc: None,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .no_proxy()
                .build()
                .expect("http client"),
        };
        xds.launch(env).await;
        xds
    }

    async fn launch(&mut self, env: &TestEnv) {
        self.proc = Some(env.spawn_with_env(
            &self.name,
            &project_bin("toolgate-xds"),
            &self.args,
            &self.envs,
        ));
        let url = format!("{}/healthz", self.admin_url());
        let http = self.http.clone();
        wait_until(
            &format!("{} answers /healthz", self.name),
            Duration::from_secs(20),
            || {
                let http = http.clone();
                let url = url.clone();
                async move { matches!(http.get(&url).send().await, Ok(r) if r.status().is_success()) }
            },
        )
        .await;
        // Failpoints exist only in a test build of toolgate-xds (`cargo test` builds one, `make
        // build` does not): without them a failpoint test would fail as if toolgate had a bug.
        if self
            .envs
            .iter()
            .any(|(k, _)| k.starts_with("TOOLGATE_FAILPOINT_"))
        {
            assert!(
                self.log().contains("failpoints compiled in"),
                "{} was built without failpoints: `cargo build --release -p toolgate-xds --features failpoints` (or `make test`) builds it with them",
                project_bin("toolgate-xds").display()
            );
        }
    }

    /// `127.0.0.1:<xds port>`, for `toolgate-xds bootstrap --xds`.
    pub fn xds_addr(&self) -> String {
        format!("127.0.0.1:{}", self.xds_port)
    }

    /// The running process's pid (0 when it is not running).
    pub fn pid(&self) -> i32 {
        self.proc.as_ref().map_or(0, |p| p.pid())
    }

    /// `127.0.0.1:<admin port>`: where Envoys reach its admin listener.
    pub fn admin_addr(&self) -> String {
        format!("127.0.0.1:{}", self.admin_port)
    }

    pub fn admin_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.admin_port)
    }

    pub fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }

    /// Stops it with SIGTERM (SIGKILL after 5 s), as an orchestrator does.
    pub async fn stop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.stop(Duration::from_secs(5)).await;
        }
    }

    pub async fn restart(&mut self, env: &TestEnv) {
        if let Some(mut p) = self.proc.take() {
            p.stop(Duration::from_secs(5)).await;
        }
        self.launch(env).await;
    }

    pub fn log(&self) -> String {
        self.proc.as_ref().map(|p| p.log()).unwrap_or_default()
    }

    pub async fn registry(&self) -> Value {
        self.http
            .get(format!("{}/v1/registry", self.admin_url()))
            .send()
            .await
            .expect("GET /v1/registry")
            .json()
            .await
            .expect("/v1/registry JSON")
    }

    /// `/v1/catalog`: each service's tool definitions as read from its servers.
    pub async fn catalog(&self) -> Value {
        self.http
            .get(format!("{}/v1/catalog", self.admin_url()))
            .send()
            .await
            .expect("GET /v1/catalog")
            .json()
            .await
            .expect("/v1/catalog JSON")
    }

    pub async fn metrics_text(&self) -> String {
        self.http
            .get(format!("{}/metrics", self.admin_url()))
            .send()
            .await
            .expect("GET /metrics")
            .text()
            .await
            .expect("/metrics text")
    }

    /// What `toolgate-xds status` prints for this toolgate-xds (reads are open unless
    /// `--protect-reads`).
    pub async fn status_text(&self) -> String {
        let out = tokio::process::Command::new(crate::paths::project_bin("toolgate-xds"))
            .args(["status", "--admin", &self.admin_url()])
            .output()
            .await
            .expect("toolgate-xds status runs");
        assert!(
            out.status.success(),
            "toolgate-xds status failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The sum of every sample of `name` whose labels contain `labels` (e.g. `type="cds"`).
    pub async fn metric(&self, name: &str, labels: &str) -> f64 {
        parse_metric(&self.metrics_text().await, name, labels)
    }
}

/// Sums the samples of one metric in Prometheus text format.
pub fn parse_metric(text: &str, name: &str, labels: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (metric, rest) = match series.split_once('{') {
                Some((m, r)) => (m, r),
                None => (series, ""),
            };
            (metric == name && rest.contains(labels)).then(|| value.parse::<f64>().ok())?
        })
        .sum()
}
