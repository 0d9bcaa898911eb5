//! A real single-member etcd on free loopback ports, restartable on the same data.

use std::time::Duration;

use etcd_client::{Client, CompactionOptions, ConnectOptions};

use crate::paths::{free_port, tool_bin};
use crate::process::Proc;
use crate::testenv::TestEnv;
use crate::wait::wait_until;

pub struct Etcd {
    name: String,
    client_port: u16,
    peer_port: u16,
    data_dir: std::path::PathBuf,
    proc: Option<Proc>,
}

impl Etcd {
    /// Starts etcd and waits until it serves requests.
    pub async fn start(env: &TestEnv) -> Etcd {
        Self::start_named(env, "etcd").await
    }

    pub async fn start_named(env: &TestEnv, name: &str) -> Etcd {
        let mut etcd = Etcd {
            name: name.to_string(),
            client_port: free_port(),
            peer_port: free_port(),
            data_dir: env.path(&format!("{name}.data")),
            proc: None,
        };
        etcd.launch(env).await;
        etcd
    }

    /// `http://127.0.0.1:<port>`, for `--etcd` flags.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    pub fn port(&self) -> u16 {
        self.client_port
    }

    pub async fn client(&self) -> Client {
        let opts = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            .with_timeout(Duration::from_secs(5));
        Client::connect([self.endpoint()], Some(opts))
            .await
            .expect("connecting to the test etcd")
    }

    async fn launch(&mut self, env: &TestEnv) {
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let args: Vec<String> = [
            "--name",
            &self.name,
            "--data-dir",
            &self.data_dir.to_string_lossy(),
            "--listen-client-urls",
            &self.endpoint(),
            "--advertise-client-urls",
            &self.endpoint(),
            "--listen-peer-urls",
            &peer,
            "--initial-advertise-peer-urls",
            &peer,
            "--initial-cluster",
            &format!("{}={peer}", self.name),
            "--listen-metrics-urls",
            "",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        self.proc = Some(env.spawn(&self.name, &tool_bin("etcd"), &args));
        let url = format!("{}/health", self.endpoint());
        let http = reqwest::Client::new();
        wait_until(
            &format!("etcd {} answers /health", self.name),
            Duration::from_secs(20),
            || async {
                match http.get(&url).send().await {
                    Ok(r) => r
                        .text()
                        .await
                        .map(|t| t.contains("\"health\":\"true\""))
                        .unwrap_or(false),
                    Err(_) => false,
                }
            },
        )
        .await;
    }

    /// SIGKILL, keeping the data for a restart.
    pub fn kill(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }

    /// SIGTERM and wait.
    pub async fn stop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.stop(Duration::from_secs(10)).await;
        }
    }

    /// Starts again on the same ports and data.
    pub async fn restart(&mut self, env: &TestEnv) {
        self.stop().await;
        self.launch(env).await;
    }

    pub fn is_running(&mut self) -> bool {
        self.proc.as_mut().is_some_and(|p| p.is_running())
    }

    /// The current revision of the store.
    pub async fn revision(&self) -> i64 {
        let mut c = self.client().await;
        let resp = c.get("/", None).await.expect("etcd get for revision");
        resp.header().map(|h| h.revision()).unwrap_or(0)
    }

    /// Compacts the history up to the current revision (physically, so watchers of older
    /// revisions get `compact_revision`).
    pub async fn compact(&self) -> i64 {
        let rev = self.revision().await;
        let mut c = self.client().await;
        c.compact(rev, Some(CompactionOptions::new().with_physical()))
            .await
            .expect("etcd compaction");
        rev
    }
}
