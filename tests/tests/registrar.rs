//! toolgate-register against a real etcd: join, leave, crash, etcd outages, child supervision
//! (restarts of a crashed server, routed again through a real Envoy; a crash loop), bad input.

use std::time::{Duration, Instant};

use etcd_client::{Client, EventType, GetOptions, WatchOptions};
use nix::sys::signal::Signal;
use nix::unistd::Pid;
use reqwest::StatusCode;
use serde_json::json;
use toolgate_model::InstanceMetadata;
use toolgate_tests::{
    free_port, project_bin, wait_until, Etcd, FaultProxy, McpSession, Registrant, ServerCommand,
    Stack, TestEnv,
};

const KEY: &str = "/mcp/services/inventory/inv-1";

fn registrant(etcd: &str, endpoint: &str, ttl: u32) -> Registrant {
    Registrant::new(etcd, "inventory", endpoint)
        .arg("--tools", "query_inventory_db,query_cached_inventory")
        .arg("--instance-id", "inv-1")
        .arg("--ttl", &ttl.to_string())
}

async fn lease_of(client: &mut Client, key: &str) -> Option<i64> {
    let resp = client.get(key, None).await.ok()?;
    resp.kvs().first().map(|kv| kv.lease())
}

async fn key_exists(client: &mut Client, key: &str) -> bool {
    lease_of(client, key).await.is_some()
}

/// Waits for the DELETE of `key` and returns when it was seen.
async fn watch_delete(client: &mut Client, key: &str) -> tokio::task::JoinHandle<Instant> {
    let mut stream = client
        .watch(key, Some(WatchOptions::new()))
        .await
        .expect("watch");
    tokio::spawn(async move {
        while let Ok(Some(resp)) = stream.message().await {
            if resp
                .events()
                .iter()
                .any(|e| e.event_type() == EventType::Delete)
            {
                return Instant::now();
            }
        }
        panic!("watch ended before the key was deleted");
    })
}

#[tokio::test]
async fn registration_is_a_leased_key_with_valid_metadata() {
    let env = TestEnv::new("registration_is_a_leased_key_with_valid_metadata");
    let etcd = Etcd::start(&env).await;
    let mut client = etcd.client().await;
    let _reg = registrant(&etcd.endpoint(), "127.0.0.1:9100", 7)
        .arg("--weight", "3")
        .arg("--label", "team=stock")
        .spawn(&env, "registrar");

    wait_until("the key exists", Duration::from_secs(10), || {
        let mut c = client.clone();
        async move { key_exists(&mut c, KEY).await }
    })
    .await;
    let resp = client.get(KEY, None).await.unwrap();
    let kv = &resp.kvs()[0];
    let meta = InstanceMetadata::from_json(kv.value()).expect("value parses as InstanceMetadata");
    assert_eq!(meta.instance_id, "inv-1");
    assert_eq!(meta.endpoint.to_string(), "127.0.0.1:9100");
    assert_eq!(meta.tools, ["query_inventory_db", "query_cached_inventory"]);
    assert_eq!(meta.weight, 3);
    assert_eq!(meta.labels.get("team").map(String::as_str), Some("stock"));
    assert_ne!(kv.lease(), 0, "the key must be bound to a lease");
    let ttl = client.lease_time_to_live(kv.lease(), None).await.unwrap();
    assert_eq!(ttl.granted_ttl(), 7, "lease granted with the requested TTL");
    assert!(ttl.ttl() > 0);
}

#[tokio::test]
async fn sigterm_revokes_the_key_at_once() {
    let env = TestEnv::new("sigterm_revokes_the_key_at_once");
    let etcd = Etcd::start(&env).await;
    let mut client = etcd.client().await;
    let mut reg = registrant(&etcd.endpoint(), "127.0.0.1:9100", 10).spawn(&env, "registrar");
    wait_until("the key exists", Duration::from_secs(10), || {
        let mut c = client.clone();
        async move { key_exists(&mut c, KEY).await }
    })
    .await;

    let deleted = watch_delete(&mut client, KEY).await;
    let signalled = Instant::now();
    reg.signal(Signal::SIGTERM);
    let seen = tokio::time::timeout(Duration::from_secs(5), deleted)
        .await
        .expect("key deleted after SIGTERM")
        .unwrap();
    let took = seen - signalled;
    println!(
        "SIGTERM -> key deleted (seen by a watch): {:.1} ms",
        took.as_secs_f64() * 1e3
    );
    assert!(took < Duration::from_millis(500), "revoke took {took:?}");
    let status = reg
        .wait_exit(Duration::from_secs(5))
        .await
        .expect("registrar exits");
    assert!(status.success(), "exit status {status}");
}

#[tokio::test]
async fn sigkill_leaves_the_key_until_the_lease_expires() {
    let env = TestEnv::new("sigkill_leaves_the_key_until_the_lease_expires");
    let etcd = Etcd::start(&env).await;
    let mut client = etcd.client().await;
    let ttl = 3;
    let mut reg = registrant(&etcd.endpoint(), "127.0.0.1:9100", ttl).spawn(&env, "registrar");
    wait_until("the key exists", Duration::from_secs(10), || {
        let mut c = client.clone();
        async move { key_exists(&mut c, KEY).await }
    })
    .await;

    let deleted = watch_delete(&mut client, KEY).await;
    let killed = Instant::now();
    reg.kill();
    let seen = tokio::time::timeout(Duration::from_secs(ttl as u64 + 5), deleted)
        .await
        .expect("key deleted when the lease expired")
        .unwrap();
    let took = seen - killed;
    println!(
        "SIGKILL -> key deleted by lease expiry: {:.2} s (TTL {ttl} s)",
        took.as_secs_f64()
    );
    // Keepalives go every TTL/3, so at the kill the lease had between 2/3 TTL and TTL left.
    assert!(
        took >= Duration::from_secs(1),
        "deleted too early ({took:?}): not by expiry"
    );
    assert!(
        took <= Duration::from_secs(ttl as u64 + 1),
        "deleted {took:?} after the kill, more than TTL + 1 s"
    );
}

#[tokio::test]
async fn registration_survives_an_etcd_restart_within_the_ttl() {
    let env = TestEnv::new("registration_survives_an_etcd_restart_within_the_ttl");
    let mut etcd = Etcd::start(&env).await;
    let ttl = 6;
    let reg = registrant(&etcd.endpoint(), "127.0.0.1:9100", ttl).spawn(&env, "registrar");
    let mut client = etcd.client().await;
    wait_until("the key exists", Duration::from_secs(10), || {
        let mut c = client.clone();
        async move { key_exists(&mut c, KEY).await }
    })
    .await;
    let lease = lease_of(&mut client, KEY).await.unwrap();

    etcd.restart(&env).await;
    wait_until(
        "the registrar reports its keepalive stream restored",
        Duration::from_secs(15),
        || async { reg.log().contains("keepalive stream restored") },
    )
    .await;
    // Two TTLs later the same lease still holds the key: keepalives really resumed.
    tokio::time::sleep(Duration::from_secs(2 * ttl as u64)).await;
    let mut client = etcd.client().await;
    assert_eq!(
        lease_of(&mut client, KEY).await,
        Some(lease),
        "same lease still holds the key"
    );
    let ttl_left = client.lease_time_to_live(lease, None).await.unwrap().ttl();
    assert!(ttl_left > 0, "lease alive, {ttl_left} s left");
    assert!(
        !reg.log().contains("registered again"),
        "must not have needed a new lease"
    );
}

#[tokio::test]
async fn registers_again_with_a_new_lease_after_etcd_was_away_longer_than_the_ttl() {
    let env =
        TestEnv::new("registers_again_with_a_new_lease_after_etcd_was_away_longer_than_the_ttl");
    let etcd = Etcd::start(&env).await;
    let proxy = FaultProxy::start(format!("127.0.0.1:{}", etcd.port()).parse().unwrap());
    let ttl = 3;
    let reg = registrant(&proxy.endpoint(), "127.0.0.1:9100", ttl).spawn(&env, "registrar");
    let mut client = etcd.client().await;
    wait_until("the key exists", Duration::from_secs(10), || {
        let mut c = client.clone();
        async move { key_exists(&mut c, KEY).await }
    })
    .await;
    let old_lease = lease_of(&mut client, KEY).await.unwrap();

    proxy.cut();
    wait_until(
        "etcd expires the lease while the registrar cannot reach it",
        Duration::from_secs(ttl as u64 + 5),
        || {
            let mut c = client.clone();
            async move { !key_exists(&mut c, KEY).await }
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let restored = Instant::now();
    proxy.restore();
    let took = wait_until(
        "the registrar registers again",
        Duration::from_secs(10),
        || {
            let mut c = client.clone();
            async move { lease_of(&mut c, KEY).await.is_some_and(|l| l != old_lease) }
        },
    )
    .await;
    println!(
        "link restored -> registered again with a new lease: {:.0} ms",
        took.as_secs_f64() * 1e3
    );
    let _ = restored;
    assert!(took < Duration::from_secs(5), "took {took:?}");
    // The registrar logs right after its put: the key can be seen before the line is written.
    wait_until(
        "the registrar says what happened",
        Duration::from_secs(2),
        || async { reg.log().contains("registered again with a new lease") },
    )
    .await;
}

#[tokio::test]
async fn child_exit_revokes_and_passes_the_exit_code_on() {
    let env = TestEnv::new("child_exit_revokes_and_passes_the_exit_code_on");
    let etcd = Etcd::start(&env).await;
    let mut client = etcd.client().await;
    // `--restart never`: the registrar's life is the server's, as under a pod's restart policy.
    let mut reg = registrant(&etcd.endpoint(), "127.0.0.1:9100", 10)
        .arg("--wait-healthy", "false")
        .arg("--restart", "never")
        .child(
            std::path::Path::new("/bin/sh"),
            &["-c".into(), "sleep 1.5; exit 7".into()],
        )
        .spawn(&env, "registrar");
    wait_until("the key exists", Duration::from_secs(10), || {
        let mut c = client.clone();
        async move { key_exists(&mut c, KEY).await }
    })
    .await;
    let status = reg
        .wait_exit(Duration::from_secs(10))
        .await
        .expect("registrar exits with its child");
    assert_eq!(
        status.code(),
        Some(7),
        "registrar passes the child's exit code on"
    );
    assert!(
        !key_exists(&mut client, KEY).await,
        "key revoked when the child exited"
    );
}

#[tokio::test]
async fn sigterm_revokes_before_the_child_gets_its_signal() {
    let env = TestEnv::new("sigterm_revokes_before_the_child_gets_its_signal");
    let etcd = Etcd::start(&env).await;
    let client = etcd.client().await;
    let seen_file = env.path("child-saw.txt");
    // The child checks etcd from its SIGTERM trap: the key must already be gone.
    let script = format!(
        "trap '{etcdctl} --endpoints {ep} get {KEY} --keys-only > {out}.tmp; mv {out}.tmp {out}; exit 3' TERM; \
         while true; do sleep 0.05; done",
        etcdctl = toolgate_tests::tool_bin("etcdctl").display(),
        ep = etcd.endpoint(),
        out = seen_file.display(),
    );
    let mut reg = registrant(&etcd.endpoint(), "127.0.0.1:9100", 10)
        .arg("--wait-healthy", "false")
        .child(std::path::Path::new("/bin/sh"), &["-c".into(), script])
        .spawn(&env, "registrar");
    wait_until("the key exists", Duration::from_secs(10), || {
        let mut c = client.clone();
        async move { key_exists(&mut c, KEY).await }
    })
    .await;
    reg.signal(Signal::SIGTERM);
    let status = reg
        .wait_exit(Duration::from_secs(10))
        .await
        .expect("registrar exits");
    assert_eq!(status.code(), Some(3), "exit code of the child");
    let seen = std::fs::read_to_string(&seen_file).expect("the child ran its SIGTERM trap");
    assert!(
        !seen.contains(KEY),
        "the child still saw its key when it got SIGTERM: {seen:?}"
    );
}

#[tokio::test]
async fn wrapped_server_is_registered_only_once_healthy() {
    let env = TestEnv::new("wrapped_server_is_registered_only_once_healthy");
    let etcd = Etcd::start(&env).await;
    let mut client = etcd.client().await;
    let port = free_port();
    let lab_args: Vec<String> = [
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--instance-id",
        "inv-1",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut reg = registrant(&etcd.endpoint(), &format!("127.0.0.1:{port}"), 10)
        .child(&project_bin("toolgate-lab"), &lab_args)
        .spawn(&env, "registrar");
    wait_until("the key exists", Duration::from_secs(20), || {
        let mut c = client.clone();
        async move { key_exists(&mut c, KEY).await }
    })
    .await;
    // Registered means healthy: the health endpoint answers now.
    let health = reqwest::get(format!("http://127.0.0.1:{port}/health"))
        .await
        .unwrap();
    assert!(health.status().is_success());
    assert!(reg.log().contains("server is healthy"));

    reg.signal(Signal::SIGTERM);
    let status = reg
        .wait_exit(Duration::from_secs(10))
        .await
        .expect("registrar exits");
    assert!(
        status.success(),
        "lab exits 0 on SIGTERM, and so does the registrar: {status}"
    );
    assert!(!key_exists(&mut client, KEY).await);
    assert!(
        reqwest::get(format!("http://127.0.0.1:{port}/health"))
            .await
            .is_err(),
        "the child was stopped"
    );
}

#[tokio::test]
async fn bad_input_exits_2_naming_the_problem_and_writes_nothing() {
    let env = TestEnv::new("bad_input_exits_2_naming_the_problem_and_writes_nothing");
    let etcd = Etcd::start(&env).await;
    let client = etcd.client().await;
    let before = etcd.revision().await;
    let ep = etcd.endpoint();
    let nowhere = format!("127.0.0.1:{}", free_port());
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec![
                "--etcd",
                &ep,
                "--service",
                "in ventory",
                "--endpoint",
                "127.0.0.1:1",
            ],
            "\"in ventory\"",
        ),
        (
            vec![
                "--etcd",
                &ep,
                "--service",
                "a/b",
                "--endpoint",
                "127.0.0.1:1",
            ],
            "\"a/b\"",
        ),
        (
            vec![
                "--etcd",
                &ep,
                "--service",
                "inv",
                "--endpoint",
                "127.0.0.1:1",
                "--tools",
                "ok,not ok",
            ],
            "\"not ok\"",
        ),
        (
            vec!["--etcd", &ep, "--service", "inv", "--endpoint", "127.0.0.1"],
            "not host:port",
        ),
        (
            vec![
                "--etcd",
                &ep,
                "--service",
                "inv",
                "--endpoint",
                "127.0.0.1:99999",
            ],
            "99999",
        ),
        (
            vec![
                "--etcd",
                &ep,
                "--service",
                "inv",
                "--endpoint",
                "127.0.0.1:1",
                "--ttl",
                "1",
            ],
            "TTL 1",
        ),
        (
            vec![
                "--etcd",
                &ep,
                "--service",
                "inv",
                "--endpoint",
                "127.0.0.1:1",
                "--weight",
                "0",
            ],
            "weight 0",
        ),
        (
            vec![
                "--etcd",
                &nowhere,
                "--service",
                "inv",
                "--endpoint",
                "127.0.0.1:1",
                // Given, so the registrar need not list them from the (absent) server first.
                "--tools",
                "t",
                "--etcd-timeout",
                "1s",
            ],
            &nowhere,
        ),
    ];
    for (args, must_mention) in cases {
        let started = Instant::now();
        let out = tokio::time::timeout(
            Duration::from_secs(15),
            tokio::process::Command::new(project_bin("toolgate-register"))
                .args(&args)
                .output(),
        )
        .await
        .unwrap_or_else(|_| panic!("toolgate-register {args:?} hung"))
        .expect("running toolgate-register");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?} exits 2; stderr: {stderr}"
        );
        assert!(
            stderr.contains(must_mention),
            "{args:?}: message names {must_mention:?}: {stderr}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{args:?} took {:?}",
            started.elapsed()
        );
    }
    assert_eq!(etcd.revision().await, before, "etcd unchanged");
    let all = client
        .clone()
        .get("/", Some(GetOptions::new().with_prefix()))
        .await
        .unwrap();
    assert_eq!(all.count(), 0, "no key written");
}

#[tokio::test]
async fn ready_tells_whether_the_instance_is_registered() {
    let env = TestEnv::new("registrar_ready");
    let etcd = Etcd::start(&env).await;
    let mut client = etcd.client().await;
    // The server is not up yet: the registrar waits for its health check, and is not ready.
    let port = free_port();
    let ready_port = free_port();
    let mut registrar = registrant(&etcd.endpoint(), &format!("127.0.0.1:{port}"), 10)
        .arg("--wait-healthy", "true")
        .arg("--ready-listen", &format!("127.0.0.1:{ready_port}"))
        .spawn(&env, "registrar");
    let http = reqwest::Client::new();
    let url = format!("http://127.0.0.1:{ready_port}/ready");
    let ready = || {
        let (http, url) = (http.clone(), url.clone());
        async move {
            match http.get(&url).send().await {
                Ok(r) => {
                    let status = r.status().as_u16();
                    (
                        status,
                        r.json::<serde_json::Value>().await.unwrap_or_default(),
                    )
                }
                Err(_) => (0, serde_json::Value::Null),
            }
        }
    };
    wait_until("/ready answers", Duration::from_secs(10), || async {
        ready().await.0 != 0
    })
    .await;
    let (status, body) = ready().await;
    assert_eq!(status, 503, "before registration: {body}");
    assert_eq!(body["state"], "starting");
    assert!(!key_exists(&mut client, KEY).await);

    let server = toolgate_tests::McpServer::lab_on(&env, "inv-1", port, &[]).await;
    wait_until("ready once registered", Duration::from_secs(10), || async {
        ready().await.0 == 200
    })
    .await;
    let (_, body) = ready().await;
    assert_eq!(body["state"], "registered");
    assert_eq!(body["key"], KEY);
    let lease = lease_of(&mut client, KEY).await.expect("registered");
    assert_eq!(body["lease"], format!("{lease:x}"));

    // SIGTERM: the registrar revokes and exits; the key is gone.
    registrar.signal(Signal::SIGTERM);
    assert!(
        registrar.wait_exit(Duration::from_secs(10)).await.is_some(),
        "the registrar exits on SIGTERM"
    );
    assert!(!key_exists(&mut client, KEY).await);
    drop(server);
}

#[tokio::test]
async fn a_sidecar_deregisters_a_crashed_server_at_once_and_registers_it_again_when_back() {
    let env = TestEnv::new("registrar_watch");
    let etcd = Etcd::start(&env).await;
    let mut client = etcd.client().await;
    let port = free_port();
    let ready_port = free_port();
    let server = toolgate_tests::McpServer::lab_on(&env, "inv-1", port, &[]).await;
    let mut registrar = registrant(&etcd.endpoint(), &format!("127.0.0.1:{port}"), 10)
        .arg("--ready-listen", &format!("127.0.0.1:{ready_port}"))
        .spawn(&env, "registrar");
    wait_until("registered", Duration::from_secs(15), || async {
        key_exists(&mut etcd.client().await, KEY).await
    })
    .await;
    let first = lease_of(&mut client, KEY).await.expect("registered");

    // SIGKILL of the server alone: its lease would live 10 s more; the registrar beside it
    // sees the refused connection and revokes.
    let deleted = watch_delete(&mut client, KEY).await;
    let killed = Instant::now();
    let mut server = server;
    server.proc.kill();
    let seen = tokio::time::timeout(Duration::from_secs(5), deleted)
        .await
        .unwrap_or_else(|_| {
            env.print_failure_logs();
            panic!("the key outlived its server by 5 s: the registrar did not notice")
        })
        .expect("watch task");
    let took = seen.duration_since(killed);
    println!(
        "server SIGKILL -> key deleted by its registrar: {} ms (watch every 250 ms)",
        took.as_millis()
    );
    assert!(took < Duration::from_secs(3), "took {took:?}");
    assert!(registrar.is_running(), "the registrar waits for its server");
    let ready = || async {
        let r = reqwest::get(format!("http://127.0.0.1:{ready_port}/ready")).await;
        match r {
            Ok(r) => r.json::<serde_json::Value>().await.unwrap_or_default(),
            Err(_) => serde_json::Value::Null,
        }
    };
    wait_until(
        "/ready says server_gone",
        Duration::from_secs(5),
        || async { ready().await["state"] == "server_gone" },
    )
    .await;

    // The server comes back on its address: registered again, under a new lease.
    let _back = toolgate_tests::McpServer::lab_on(&env, "inv-1", port, &[]).await;
    wait_until("registered again", Duration::from_secs(20), || async {
        key_exists(&mut etcd.client().await, KEY).await
    })
    .await;
    let again = lease_of(&mut client, KEY).await.expect("registered again");
    assert_ne!(again, first, "a new lease");
    registrar.signal(Signal::SIGTERM);
    assert!(registrar.wait_exit(Duration::from_secs(10)).await.is_some());
    assert!(!key_exists(&mut client, KEY).await);
}

/// The processes `pid` started (its children, from every thread).
fn children(pid: i32) -> Vec<i32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|c| {
            c.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<i32>>()
        })
        .collect()
}

/// One `tools/call` of `echo` through the gateway's route of `orders`: the server's own answer.
async fn call_succeeds(url: &str) -> bool {
    let mut s = McpSession::unconnected(url);
    if s.initialize().await.status != StatusCode::OK {
        return false;
    }
    let r = s.call_tool("echo", json!({"n": 1})).await;
    r.status == StatusCode::OK && r.breaker_state().is_none() && r.result().is_some()
}

#[tokio::test]
async fn a_killed_wrapped_server_is_restarted_deregistered_meanwhile_and_routed_again() {
    let env = TestEnv::new("registrar_restart_after_sigkill");
    let stack = Stack::start(&env).await;
    let mut client = stack.etcd.client().await;
    let key = "/mcp/services/orders/lab-1";
    let lab = ServerCommand::lab(free_port(), "lab-1", &[]);
    let endpoint = lab.endpoint();
    let mut registrar = Registrant::new(&stack.etcd.endpoint(), "orders", &endpoint)
        .arg("--instance-id", "lab-1")
        .arg("--tools", "read_order,write_order,echo")
        .arg("--ttl", "10")
        .server(&lab)
        .spawn(&env, "registrar");
    stack
        .wait_healthy_addresses(
            "orders",
            std::slice::from_ref(&endpoint),
            Duration::from_secs(30),
        )
        .await;
    let url = stack.url("orders");
    assert!(
        call_succeeds(&url).await,
        "a call through Envoy before the kill"
    );
    let first_lease = lease_of(&mut client, key).await.expect("registered");
    let first = children(registrar.pid());
    assert_eq!(first.len(), 1, "the registrar runs one child: {first:?}");

    // SIGKILL of the server alone: the registrar revokes at once (the lease would live 10 s).
    let deleted = watch_delete(&mut client, key).await;
    let killed = Instant::now();
    nix::sys::signal::kill(Pid::from_raw(first[0]), Signal::SIGKILL).expect("kill the server");
    let seen = tokio::time::timeout(Duration::from_secs(3), deleted)
        .await
        .unwrap_or_else(|_| {
            env.print_failure_logs();
            panic!("the key outlived its killed server by 3 s")
        })
        .expect("watch task");
    println!(
        "server SIGKILL -> deregistered: {} ms",
        seen.duration_since(killed).as_millis()
    );
    // Envoy stops routing to it meanwhile (the restart waits at least half a second).
    wait_until(
        "Envoy routes orders nowhere while the server restarts",
        Duration::from_millis(500),
        || async { stack.healthy("orders").await.is_empty() },
    )
    .await;

    // Restarted (a new process), registered again under a new lease, routed, and answering.
    let (lease, took) = toolgate_tests::wait_for(
        "the restarted server is registered again",
        Duration::from_secs(20),
        || {
            let mut c = client.clone();
            async move { lease_of(&mut c, key).await.filter(|l| *l != first_lease) }
        },
    )
    .await;
    println!(
        "deregistered -> registered again (lease {lease:x}): {} ms",
        took.as_millis()
    );
    assert!(registrar.is_running(), "the registrar lives on");
    let again = children(registrar.pid());
    assert_eq!(again.len(), 1, "{again:?}");
    assert_ne!(again, first, "a new server process");
    stack
        .wait_healthy_addresses(
            "orders",
            std::slice::from_ref(&endpoint),
            Duration::from_secs(20),
        )
        .await;
    wait_until(
        "a call through Envoy succeeds on the restarted server",
        Duration::from_secs(10),
        || call_succeeds(&url),
    )
    .await;
    let log = registrar.log();
    assert!(log.contains("restarting the server"), "{log}");

    // SIGTERM to the registrar still ends both, deregistered, with no restart.
    registrar.signal(Signal::SIGTERM);
    let status = registrar
        .wait_exit(Duration::from_secs(10))
        .await
        .expect("the registrar exits on SIGTERM");
    assert!(status.success(), "the lab exits 0 on SIGTERM: {status}");
    assert!(!key_exists(&mut client, key).await);
    assert!(
        reqwest::get(format!("http://{endpoint}/health"))
            .await
            .is_err(),
        "the server was stopped, not restarted"
    );
}

#[tokio::test]
async fn a_crash_loop_ends_the_registrar_after_the_limit() {
    let env = TestEnv::new("registrar_crash_loop");
    let etcd = Etcd::start(&env).await;
    let mut client = etcd.client().await;
    let starts = env.path("starts.txt");
    let started = Instant::now();
    let mut reg = registrant(&etcd.endpoint(), &format!("127.0.0.1:{}", free_port()), 10)
        .arg("--restart-limit", "2")
        .arg("--restart-delay", "200ms")
        .child(
            std::path::Path::new("/bin/sh"),
            &[
                "-c".into(),
                format!("echo start >> {}; exit 1", starts.display()),
            ],
        )
        .spawn(&env, "registrar");
    let status = reg
        .wait_exit(Duration::from_secs(20))
        .await
        .unwrap_or_else(|| {
            env.print_failure_logs();
            panic!("the registrar still runs its crash-looping server after 20 s")
        });
    println!(
        "crash loop -> the registrar gave up after {} ms",
        started.elapsed().as_millis()
    );
    assert_eq!(
        status.code(),
        Some(1),
        "non-zero, the server's code: {status}"
    );
    let runs = std::fs::read_to_string(&starts).unwrap_or_default();
    assert_eq!(
        runs.lines().count(),
        3,
        "the first start and 2 restarts: {runs:?}"
    );
    let log = reg.log();
    assert!(
        log.contains("giving up: the server exited 3 times in a row")
            && log.contains("--restart-limit"),
        "{log}"
    );
    assert!(!key_exists(&mut client, KEY).await, "never registered");
}
