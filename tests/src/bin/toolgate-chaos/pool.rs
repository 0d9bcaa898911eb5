//! The lab service's pods: `toolgate-register` with a `toolgate-lab` child, as a platform runs
//! them. Every pod that is started is a new incarnation with its own instance id and port, so a
//! reply names exactly which process answered.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use toolgate_tests::{free_port, project_bin, Proc, Registrant, TestEnv};

/// Lease TTL of every pod, the production default.
pub const TTL_SECS: u32 = 10;

pub struct Pod {
    registrar: Proc,
    /// The lab server, the registrar's child (in its own process group).
    server_pid: Option<i32>,
    pub stopped: bool,
}

pub struct Pool {
    etcd: String,
    service: String,
    next: u32,
    ports: HashSet<u16>,
    pub pods: BTreeMap<String, Pod>,
    /// Pods on their way out (gracefully stopping, or killed and not yet reaped).
    leaving: Vec<Proc>,
}

impl Pool {
    pub fn new(etcd: &str, service: &str) -> Pool {
        Pool {
            etcd: etcd.to_string(),
            service: service.to_string(),
            next: 0,
            ports: HashSet::new(),
            pods: BTreeMap::new(),
            leaving: Vec::new(),
        }
    }

    /// Starts a new pod; it registers itself once its server answers its health check.
    pub fn spawn(&mut self, env: &TestEnv) -> String {
        // A port never used before in this run: an address names one incarnation.
        let port = loop {
            let p = free_port();
            if self.ports.insert(p) {
                break p;
            }
        };
        self.next += 1;
        let id = format!("{}-{:03}", self.service, self.next);
        let lab: Vec<String> = [
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--instance-id",
            &id,
            "--stateless",
            "--json-response",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let registrar = Registrant::new(&self.etcd, &self.service, &format!("127.0.0.1:{port}"))
            .arg("--instance-id", &id)
            .arg("--tools", "read_order,write_order,echo")
            .arg("--ttl", &TTL_SECS.to_string())
            .arg("--stop-timeout", "5s")
            // A pod: its platform, not the registrar, restarts what crashed (here: the run
            // replaces the pod), so a crashed server ends its registrar.
            .arg("--restart", "never")
            .child(&project_bin("toolgate-lab"), &lab)
            .spawn(env, &id);
        self.pods.insert(
            id.clone(),
            Pod {
                registrar,
                server_pid: None,
                stopped: false,
            },
        );
        id
    }

    /// Pods that are running (not stopped), in id order.
    pub fn running(&self) -> Vec<String> {
        self.pods
            .iter()
            .filter(|(_, p)| !p.stopped)
            .map(|(id, _)| id.clone())
            .collect()
    }

    pub fn stopped(&self) -> Vec<String> {
        self.pods
            .iter()
            .filter(|(_, p)| p.stopped)
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// SIGKILL to the server and the registrar at once, as when a node or a pod dies: nobody
    /// revokes the lease, which lives on until its TTL runs out.
    pub fn kill(&mut self, id: &str) {
        if let Some(mut pod) = self.pods.remove(id) {
            if let Some(pid) = pod.server_pid(id) {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
            pod.registrar.signal(Signal::SIGKILL);
            self.leaving.push(pod.registrar);
        }
    }

    /// SIGKILL to the server only, as the OOM killer does: its registrar sees the exit and
    /// revokes the lease.
    pub fn crash(&mut self, id: &str) {
        if let Some(mut pod) = self.pods.remove(id) {
            if let Some(pid) = pod.server_pid(id) {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
            self.leaving.push(pod.registrar);
        }
    }

    /// SIGTERM to the registrar: it revokes the lease, then stops its server.
    pub fn terminate(&mut self, id: &str) {
        if let Some(pod) = self.pods.remove(id) {
            pod.registrar.signal(Signal::SIGTERM);
            self.leaving.push(pod.registrar);
        }
    }

    /// SIGSTOP to the server and the registrar: no answers, no keepalives.
    pub fn stop(&mut self, id: &str) {
        if let Some(pod) = self.pods.get_mut(id) {
            pod.signal(id, Signal::SIGSTOP);
            pod.stopped = true;
        }
    }

    pub fn cont(&mut self, id: &str) {
        if let Some(pod) = self.pods.get_mut(id) {
            pod.signal(id, Signal::SIGCONT);
            pod.stopped = false;
        }
    }

    /// Reaps pods that left, and forgets pods whose registrar exited on its own (returned).
    pub fn reap(&mut self) -> Vec<String> {
        self.leaving.retain_mut(|p| p.is_running());
        let gone: Vec<String> = self
            .pods
            .iter_mut()
            .filter_map(|(id, p)| (!p.stopped && !p.registrar.is_running()).then_some(id))
            .cloned()
            .collect();
        for id in &gone {
            self.pods.remove(id);
        }
        gone
    }

    /// Waits up to `grace` for leaving pods to exit, then kills what is left.
    pub async fn shutdown(&mut self, grace: Duration) {
        let ids: Vec<String> = self.pods.keys().cloned().collect();
        for id in &ids {
            self.cont(id);
            self.terminate(id);
        }
        let started = std::time::Instant::now();
        while started.elapsed() < grace {
            self.leaving.retain_mut(|p| p.is_running());
            if self.leaving.is_empty() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for p in &mut self.leaving {
            p.kill();
        }
    }
}

impl Pod {
    /// The lab server's pid: the registrar's only child (found once, then remembered).
    fn server_pid(&mut self, id: &str) -> Option<i32> {
        if self.server_pid.is_none() {
            let pid = self.registrar.pid();
            let children =
                std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).ok()?;
            self.server_pid = children.split_whitespace().next()?.parse().ok();
            if self.server_pid.is_none() {
                eprintln!("chaos: pod {id} has no server process yet");
            }
        }
        self.server_pid
    }

    fn signal(&mut self, id: &str, sig: Signal) {
        if let Some(pid) = self.server_pid(id) {
            let _ = kill(Pid::from_raw(pid), sig);
        }
        self.registrar.signal(sig);
    }
}

impl Drop for Pool {
    /// The servers are not in their registrars' process groups: a stopped one would outlive
    /// the run, so each gets SIGKILL here, however the run ends.
    fn drop(&mut self) {
        let ids: Vec<String> = self.pods.keys().cloned().collect();
        for id in ids {
            if let Some(pod) = self.pods.get_mut(&id) {
                if let Some(pid) = pod.server_pid(&id) {
                    let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
                }
            }
        }
    }
}
