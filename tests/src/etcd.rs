//! A real etcd on free loopback ports, restartable on the same data: one member, or a cluster of
//! several whose leader a test can find and kill.

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
    /// `--initial-cluster`: this member alone, or every member of its cluster.
    initial_cluster: String,
    proc: Option<Proc>,
}

impl Etcd {
    /// Starts etcd and waits until it serves requests.
    pub async fn start(env: &TestEnv) -> Etcd {
        Self::start_named(env, "etcd").await
    }

    pub async fn start_named(env: &TestEnv, name: &str) -> Etcd {
        let mut etcd = Self::unstarted(env, name);
        etcd.initial_cluster = format!("{name}={}", etcd.peer_url());
        etcd.launch(env).await;
        etcd
    }

    fn unstarted(env: &TestEnv, name: &str) -> Etcd {
        Etcd {
            name: name.to_string(),
            client_port: free_port(),
            peer_port: free_port(),
            data_dir: env.path(&format!("{name}.data")),
            initial_cluster: String::new(),
            proc: None,
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    fn peer_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.peer_port)
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

    /// A client with short timeouts, `None` if the member does not answer.
    async fn try_client(&self) -> Option<Client> {
        let opts = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(1))
            .with_timeout(Duration::from_secs(2));
        Client::connect([self.endpoint()], Some(opts)).await.ok()
    }

    async fn launch(&mut self, env: &TestEnv) {
        self.spawn(env);
        self.wait_healthy().await;
    }

    fn spawn(&mut self, env: &TestEnv) {
        let peer = self.peer_url();
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
            &self.initial_cluster,
            "--initial-cluster-token",
            "toolgate-test",
            "--listen-metrics-urls",
            "",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        self.proc = Some(env.spawn(&self.name, &tool_bin("etcd"), &args));
    }

    /// Waits until the member answers `/health` as healthy (in a cluster: it has a leader).
    async fn wait_healthy(&self) {
        let url = format!("{}/health", self.endpoint());
        let http = reqwest::Client::new();
        wait_until(
            &format!("etcd {} answers /health", self.name),
            Duration::from_secs(20),
            || async {
                match http.get(&url).timeout(Duration::from_secs(2)).send().await {
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

/// A cluster of etcd members on loopback; members are killed and restarted by index.
pub struct EtcdCluster {
    pub members: Vec<Etcd>,
}

impl EtcdCluster {
    /// Starts `size` members (`<name>-0`, `<name>-1`, ...) and waits until all are healthy.
    pub async fn start(env: &TestEnv, name: &str, size: usize) -> EtcdCluster {
        let mut members: Vec<Etcd> = (0..size)
            .map(|i| Etcd::unstarted(env, &format!("{name}-{i}")))
            .collect();
        let initial = members
            .iter()
            .map(|m| format!("{}={}", m.name, m.peer_url()))
            .collect::<Vec<_>>()
            .join(",");
        // All must start before any is healthy: a member has no leader until a quorum runs.
        for m in &mut members {
            m.initial_cluster = initial.clone();
            m.spawn(env);
        }
        for m in &members {
            m.wait_healthy().await;
        }
        EtcdCluster { members }
    }

    /// Every member's client URL, comma-separated, for `--etcd` flags.
    pub fn endpoints(&self) -> String {
        self.members
            .iter()
            .map(Etcd::endpoint)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// A client over all the running members.
    pub async fn client(&mut self) -> Client {
        let running: Vec<String> = self
            .members
            .iter_mut()
            .filter_map(|m| m.is_running().then(|| m.endpoint()))
            .collect();
        let opts = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            .with_timeout(Duration::from_secs(5));
        Client::connect(running, Some(opts))
            .await
            .expect("connecting to the test etcd cluster")
    }

    /// The index of the member that is leader now, as the running members report it.
    pub async fn leader(&mut self) -> Option<usize> {
        let mut ids = Vec::new();
        let mut leader = None;
        for m in self.members.iter_mut() {
            if !m.is_running() {
                ids.push(None);
                continue;
            }
            let status = match m.try_client().await {
                Some(mut c) => c.status().await.ok(),
                None => None,
            };
            ids.push(
                status
                    .as_ref()
                    .and_then(|s| s.header().map(|h| h.member_id())),
            );
            if let Some(s) = status.filter(|s| s.leader() != 0) {
                leader = Some(s.leader());
            }
        }
        let leader = leader?;
        ids.iter().position(|id| *id == Some(leader))
    }

    /// Waits until the running members agree on a leader, and returns its index.
    pub async fn wait_leader(&mut self, timeout: Duration) -> usize {
        let started = std::time::Instant::now();
        loop {
            if let Some(i) = self.leader().await {
                return i;
            }
            assert!(
                started.elapsed() < timeout,
                "no etcd leader within {timeout:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The member id each member reports for itself (`None` for a member that does not answer).
    pub async fn member_ids(&mut self) -> Vec<Option<u64>> {
        let mut ids = Vec::new();
        for m in self.members.iter_mut() {
            let id = match m.is_running() {
                true => match m.try_client().await {
                    Some(mut c) => c
                        .status()
                        .await
                        .ok()
                        .and_then(|s| s.header().map(|h| h.member_id())),
                    None => None,
                },
                false => None,
            };
            ids.push(id);
        }
        ids
    }

    /// Hands leadership to member `to` (asked of the current leader, the only one that can).
    pub async fn move_leader(&mut self, to: usize) {
        let leader = self.wait_leader(Duration::from_secs(10)).await;
        if leader == to {
            return;
        }
        let target = self.member_ids().await[to].expect("the new leader answers");
        let mut c = self.members[leader].client().await;
        c.move_leader(target).await.expect("etcd move-leader");
        let started = std::time::Instant::now();
        while self.leader().await != Some(to) {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "leadership did not move to {}",
                self.members[to].name
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// How many watchers member `i` serves (etcd's own gauge), 0 if it does not answer.
    pub async fn watchers(&self, i: usize) -> u64 {
        let url = format!("{}/metrics", self.members[i].endpoint());
        let text = match reqwest::get(&url).await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => return 0,
        };
        text.lines()
            .find_map(|l| l.strip_prefix("etcd_debugging_mvcc_watcher_total "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .map_or(0, |v| v as u64)
    }

    /// SIGKILLs member `i`, keeping its data.
    pub fn kill(&mut self, i: usize) {
        self.members[i].kill();
    }

    /// Starts member `i` again on its data (it rejoins the cluster) and waits until healthy.
    pub async fn restart(&mut self, env: &TestEnv, i: usize) {
        self.members[i].restart(env).await;
    }
}
