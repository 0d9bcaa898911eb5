//! An Envoy leaving service under agent load answers every call it accepted: through a hot
//! restart, and through the Kubernetes manifest's preStop drain before SIGTERM.
//!
//! Both hinge on the same fact: draining closes an HTTP/1 keep-alive connection only after
//! its next response, so a client may start one more call on a draining Envoy as the drain
//! ends. The Envoy must stay up for the drain plus that call.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use serde_json::{json, Value};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use toolgate_tests::envoy::DRAIN_TIME;
use toolgate_tests::{wait_until, Envoy, Etcd, McpSession, Member, TestEnv, Xds};

/// Each call takes this long at the server: long enough that a call started on a draining
/// Envoy as the drain ends is still running when a too-short wait runs out.
const CALL: Duration = Duration::from_millis(3000);
/// Six agents calling back to back start a call every CALL / 6 on average.
const AGENTS: u64 = 6;

struct Rig {
    env: TestEnv,
    envoy: Envoy,
    _etcd: Etcd,
    _xds: Xds,
    _member: Member,
}

/// Envoy with the filter (two workers) in front of one instance whose calls take [`CALL`].
async fn rig(name: &str) -> Rig {
    let env = TestEnv::new(name);
    let etcd = Etcd::start(&env).await;
    let xds = Xds::start(&env, "xds", &etcd.endpoint(), &[]).await;
    // Calls this slow are the service's normal: the breaker must not count them as slow.
    etcd.client()
        .await
        .put(
            "/mcp/policies/slow",
            json!({"slow_call_ms": 10 * CALL.as_millis()}).to_string(),
            None,
        )
        .await
        .expect("writing the policy");
    let envoy = Envoy::start_with_filter(&env, "envoy", &xds, 2, &[]).await;
    let latency = CALL.as_millis().to_string();
    let member = Member::start(
        &env,
        &etcd.endpoint(),
        "slow",
        "slow-1",
        &["--stateless", "--json-response", "--latency-ms", &latency],
        10,
    )
    .await;
    wait_until(
        "envoy routes to slow-1",
        Duration::from_secs(20),
        || async { envoy.addresses("slow").await == vec![member.server.endpoint()] },
    )
    .await;
    Rig {
        env,
        envoy,
        _etcd: etcd,
        _xds: xds,
        _member: member,
    }
}

#[derive(Debug)]
enum Outcome {
    Answered,
    /// The TCP connection was refused: Envoy never accepted the call (its listeners had
    /// stopped), and a client behind a Service would have reached another Envoy.
    Refused,
    Failed(String),
}

struct Call {
    sent: Duration,
    done: Duration,
    outcome: Outcome,
}

/// Keep-alive agents calling back to back, started at staggered times so that some call is
/// always about to start. An agent stops at the first refused connection.
struct Agents {
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<Vec<Call>>>,
}

impl Agents {
    fn start(url: &str, t0: Instant) -> Agents {
        let (stop, stopped) = watch::channel(false);
        let tasks = (0..AGENTS)
            .map(|agent| {
                let (url, stopped) = (url.to_string(), stopped.clone());
                tokio::spawn(async move {
                    tokio::time::sleep(CALL / AGENTS as u32 * agent as u32).await;
                    let mut s = McpSession::connect(&url).await;
                    let mut calls = Vec::new();
                    while !*stopped.borrow() {
                        let sent = t0.elapsed();
                        let r = s.call_tool("echo", json!({"text": "hi"})).await;
                        let outcome = if r.result().is_some_and(|res| res["isError"] != true) {
                            Outcome::Answered
                        } else if r.status.as_u16() == 599 && r.body.contains("Connection refused")
                        {
                            Outcome::Refused
                        } else {
                            Outcome::Failed(format!("{} {}", r.status, r.body))
                        };
                        let refused = matches!(outcome, Outcome::Refused);
                        calls.push(Call {
                            sent,
                            done: t0.elapsed(),
                            outcome,
                        });
                        if refused {
                            break;
                        }
                    }
                    calls
                })
            })
            .collect();
        Agents { stop, tasks }
    }

    async fn finish(self) -> Vec<Call> {
        let _ = self.stop.send(true);
        let mut calls = Vec::new();
        for t in self.tasks {
            calls.extend(t.await.expect("agent task"));
        }
        calls.sort_by_key(|c| c.sent);
        calls
    }
}

/// Panics naming every call that Envoy accepted and did not answer.
fn assert_accepted_calls_answered(calls: &[Call]) {
    let failed: Vec<String> = calls
        .iter()
        .filter_map(|c| match &c.outcome {
            Outcome::Failed(why) => Some(format!("sent {:?}, ended {:?}: {why}", c.sent, c.done)),
            _ => None,
        })
        .collect();
    assert!(
        failed.is_empty(),
        "{} of {} calls were accepted and not answered:\n{}",
        failed.len(),
        calls.len(),
        failed.join("\n")
    );
}

fn count(calls: &[Call], what: impl Fn(&Call) -> bool) -> usize {
    calls.iter().filter(|c| what(c)).count()
}

#[tokio::test]
async fn calls_in_flight_and_sent_during_an_envoy_hot_restart_are_all_answered() {
    let mut rig = rig("envoy_drain_hot_restart").await;
    let t0 = Instant::now();
    let agents = Agents::start(&rig.envoy.url("slow"), t0);
    tokio::time::sleep(CALL * 2).await;
    let restart_at = t0.elapsed();
    rig.envoy.hot_restart(&rig.env, CALL).await;
    let parent_gone = t0.elapsed();
    println!(
        "hot restart at {restart_at:?}; the parent exited {:?} later (--parent-shutdown-time-s {})",
        parent_gone - restart_at,
        rig.envoy.parent_shutdown().as_secs()
    );
    tokio::time::sleep(CALL * 2).await;
    let calls = agents.finish().await;

    let during = count(&calls, |c| c.sent > restart_at && c.sent < parent_gone);
    let after = count(&calls, |c| {
        c.sent > parent_gone && matches!(c.outcome, Outcome::Answered)
    });
    println!(
        "{} calls, {during} sent while the parent drained, {after} answered after it",
        calls.len()
    );
    // A hot restart hands the listening sockets over: no connection is ever refused.
    assert_eq!(
        count(&calls, |c| matches!(c.outcome, Outcome::Refused)),
        0,
        "refused connections"
    );
    assert_accepted_calls_answered(&calls);
    assert!(
        during >= AGENTS as usize,
        "{during} calls sent during the drain"
    );
    assert!(
        after >= AGENTS as usize,
        "{after} calls answered by the new epoch"
    );
}

/// The Envoy container's preStop script from deploy/kubernetes/envoy.yaml.
fn pre_stop_script() -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/kubernetes/envoy.yaml");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    let deployment: Value = serde_norway::Deserializer::from_str(&text)
        .map(|d| <Value as serde::Deserialize>::deserialize(d).expect("envoy.yaml is YAML"))
        .find(|d| d["kind"] == "Deployment")
        .expect("envoy.yaml has a Deployment");
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    let command = &container["lifecycle"]["preStop"]["exec"]["command"];
    assert_eq!(command[0], "/bin/bash", "{command}");
    assert_eq!(command[1], "-c", "{command}");
    command[2]
        .as_str()
        .expect("the preStop script is a string")
        .to_string()
}

#[tokio::test]
async fn the_kubernetes_pre_stop_hook_drains_envoy_so_sigterm_cuts_no_call() {
    let script = pre_stop_script();
    let mut rig = rig("envoy_drain_pre_stop").await;
    let t0 = Instant::now();
    let agents = Agents::start(&rig.envoy.url("slow"), t0);
    tokio::time::sleep(CALL * 2).await;

    // What the kubelet does at pod deletion: the hook, then SIGTERM.
    let hook_at = t0.elapsed();
    let hook = tokio::process::Command::new("bash")
        .args(["-c", &script])
        .env("ENVOY_ADMIN_PORT", rig.envoy.admin_port.to_string())
        .env("TOOLGATE_DRAIN_SECONDS", DRAIN_TIME.as_secs().to_string())
        .env("TOOLGATE_LONGEST_CALL_SECONDS", CALL.as_secs().to_string())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(DRAIN_TIME + CALL + Duration::from_secs(20), hook)
        .await
        .expect("the preStop hook returns")
        .expect("running bash");
    let hook_done = t0.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("draining"),
        "preStop hook: {:?}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let proc = rig.envoy.proc.as_mut().expect("envoy runs");
    assert!(proc.is_running(), "envoy exited before the hook returned");
    proc.signal(Signal::SIGTERM);
    assert!(
        proc.wait_exit(Duration::from_secs(10)).await.is_some(),
        "envoy exits on SIGTERM"
    );
    let calls = agents.finish().await;

    let drain_end = hook_at + DRAIN_TIME;
    let during = count(&calls, |c| {
        c.sent > hook_at && c.sent < drain_end && matches!(c.outcome, Outcome::Answered)
    });
    let refused = count(&calls, |c| matches!(c.outcome, Outcome::Refused));
    println!(
        "hook at {hook_at:?}, returned after {:?}; {} calls, {during} answered that were sent \
         during the drain, {refused} refused after it",
        hook_done - hook_at,
        calls.len()
    );
    assert_accepted_calls_answered(&calls);
    // The drain keeps accepting (the Service needs time to take the pod out), then stops.
    assert!(during >= 1, "no call sent during the drain was answered");
    for c in calls
        .iter()
        .filter(|c| matches!(c.outcome, Outcome::Refused))
    {
        assert!(
            c.sent > drain_end - Duration::from_millis(200),
            "a connection was refused at {:?}, before the drain ended at {drain_end:?}",
            c.sent
        );
    }
    assert!(
        hook_done - hook_at >= DRAIN_TIME + CALL,
        "the hook returned after {:?}",
        hook_done - hook_at
    );
}
