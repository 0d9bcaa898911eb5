//! The official MCP conformance suite (`@modelcontextprotocol/conformance`, pinned in
//! tests/node) against the reference everything-server, once directly and once through a
//! virtual server that holds only it (`naming: bare`): the gateway must pass exactly the
//! scenarios the server passes on its own. Real etcd, toolgate-xds, Envoy with the filter.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};
use toolgate_tests::{
    conformance_cli, free_port, wait_until, Registrant, ServerCommand, Stack, TestEnv,
};

/// Each check of each scenario, `"<scenario> / <check id>"`, with its status (`SUCCESS`,
/// `FAILURE`, `WARNING`, `INFO`), from the suite's `-o` directory.
fn checks_in(dir: &Path) -> BTreeMap<String, String> {
    let mut checks = BTreeMap::new();
    let Ok(runs) = std::fs::read_dir(dir) else {
        return checks;
    };
    for run in runs.flatten() {
        // `server-<scenario>-<timestamp>`: the timestamp starts at the first `-20`.
        let name = run.file_name().to_string_lossy().to_string();
        let scenario = name
            .strip_prefix("server-")
            .and_then(|n| n.find("-20").map(|at| n[..at].to_string()))
            .unwrap_or(name);
        let Ok(text) = std::fs::read_to_string(run.path().join("checks.json")) else {
            continue;
        };
        let list: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        for check in list.as_array().into_iter().flatten() {
            let id = check["id"].as_str().unwrap_or("?");
            let status = check["status"].as_str().unwrap_or("?");
            // A check id may repeat inside a scenario; the worst status stands.
            let key = format!("{scenario} / {id}");
            let slot = checks.entry(key).or_insert_with(|| status.to_string());
            if status == "FAILURE" {
                *slot = status.to_string();
            }
        }
    }
    checks
}

/// Runs the whole active suite against `url`, results into `out`.
async fn run_suite(env: &TestEnv, url: &str, out: &Path) -> BTreeMap<String, String> {
    let log = std::fs::File::create(env.path(&format!(
        "conformance.{}.log",
        out.file_name().unwrap_or_default().to_string_lossy()
    )))
    .expect("conformance log");
    let status = tokio::time::timeout(
        Duration::from_secs(240),
        tokio::process::Command::new("node")
            .arg(conformance_cli())
            .args(["server", "--url", url, "-o"])
            .arg(out)
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .kill_on_drop(true)
            .status(),
    )
    .await;
    assert!(
        status.is_ok(),
        "the conformance suite did not finish within 240 s against {url}"
    );
    let checks = checks_in(out);
    assert!(!checks.is_empty(), "the suite wrote no checks for {url}");
    checks
}

/// The scenarios that pass: at least one check succeeded and none failed (a check may also
/// be informational or a warning: the everything-server streams every answer, the gateway
/// answers its own in JSON, which the suite notes as `INFO`, not as a failure).
fn passing(checks: &BTreeMap<String, String>) -> Vec<&str> {
    let mut scenarios: BTreeMap<&str, (bool, bool)> = BTreeMap::new();
    for (key, status) in checks {
        let scenario = key.split(" / ").next().unwrap_or(key);
        let (succeeded, failed) = scenarios.entry(scenario).or_default();
        *succeeded |= status == "SUCCESS";
        *failed |= status == "FAILURE";
    }
    scenarios
        .into_iter()
        .filter(|(_, (succeeded, failed))| *succeeded && !*failed)
        .map(|(s, _)| s)
        .collect()
}

#[tokio::test]
async fn the_conformance_suite_passes_the_same_scenarios_through_a_virtual_server() {
    let env = TestEnv::new("conformance_everything");
    let stack = Stack::start(&env).await;
    let cmd = ServerCommand::everything(free_port());
    let _server = cmd.spawn(&env, "ev");
    let _registrar = Registrant::new(&stack.etcd.endpoint(), "ev", &cmd.endpoint())
        .arg("--instance-id", "ev-1")
        .arg("--probe", "mcp")
        .spawn(&env, "ev.registrar");
    stack
        .wait_state("ev", "ev-1", "UP", Duration::from_secs(30))
        .await;
    stack
        .admin_put(
            "/v1/virtual/ev",
            &json!({"naming": "bare", "include": ["ev/*"]}),
        )
        .await;
    let service_url = stack.url("ev");
    let through = service_url.replace("/mcp/ev", "/virtual/ev");
    let http = reqwest::Client::new();
    wait_until(
        "the virtual server lists the everything-server's prompts",
        Duration::from_secs(30),
        || async {
            let body = json!({"jsonrpc": "2.0", "id": 1, "method": "prompts/list",
                "params": {"_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28"}}});
            let Ok(r) = http
                .post(&through)
                .header("accept", "application/json, text/event-stream")
                .header("mcp-protocol-version", "2026-07-28")
                .json(&body)
                .send()
                .await
            else {
                return false;
            };
            r.text().await.is_ok_and(|t| t.contains("simple-prompt"))
        },
    )
    .await;

    let direct = run_suite(
        &env,
        &format!("http://{}/mcp", cmd.endpoint()),
        &env.path("direct"),
    )
    .await;
    let gateway = run_suite(&env, &through, &env.path("gateway")).await;
    let (direct_pass, gateway_pass) = (passing(&direct), passing(&gateway));
    if direct_pass != gateway_pass {
        env.print_failure_logs();
    }
    let lost: Vec<_> = direct_pass
        .iter()
        .filter(|c| !gateway_pass.contains(c))
        .collect();
    let gained: Vec<_> = gateway_pass
        .iter()
        .filter(|c| !direct_pass.contains(c))
        .collect();
    assert!(
        lost.is_empty() && gained.is_empty(),
        "the suite passes different scenarios through the gateway ({through}):\n\
         passing directly only: {lost:#?}\npassing through the gateway only: {gained:#?}\n\
         checks directly: {direct:#?}\nchecks through the gateway: {gateway:#?}"
    );
    // The everything-server is not the suite's own test server: many scenarios call tools it
    // does not have. What it passes must still be the core of the protocol.
    for core in [
        "server-initialize",
        "ping",
        "tools-list",
        "resources-list",
        "prompts-list",
    ] {
        assert!(
            direct_pass.contains(&core),
            "the everything-server no longer passes {core} directly: {direct:#?}"
        );
    }
}
