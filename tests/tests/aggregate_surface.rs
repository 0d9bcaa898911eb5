//! Resources and prompts through one URL: `/mcp` lists the resources, resource templates and
//! prompts of every service (from what toolgate-xds read, merged), and sends `resources/read`
//! and `prompts/get` to the service that owns the URI or the prompt, on the session the
//! gateway holds for the client. The official clients (Python SDK, TypeScript SDK 1.x and 2.x)
//! against the reference everything-server, the official Python SDK server and the lab (tools
//! only); then two services with the same resource URI and the same prompt name, both
//! reachable under the names the README documents. Real etcd, toolgate-xds, Envoy with the
//! filter.

use std::time::Duration;

use serde_json::{json, Value};
use toolgate_tests::{sdk, wait_until, Member, NodeClient, Sdk, Stack, TestEnv};

/// The Python server's resource and prompt, and what they answer.
const SECRET: &str = "secret://report";
const SECRET_TEXT: &str = "TOP-SECRET-RESOURCE-CONTENT";
/// One of the everything-server's templates, and a URI it makes.
const EV_TEMPLATE: &str = "demo://resource/dynamic/text/{resourceId}";
const EV_DYNAMIC: &str = "demo://resource/dynamic/text/1";

/// The strings at `field` of each element of `list` (`uri` of resources, `name` of prompts).
fn fields<'a>(list: &'a Value, field: &str) -> Vec<&'a str> {
    list.as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v[field].as_str())
        .collect()
}

/// The texts of a `resources/read` result's contents.
fn read_texts(result: &Value) -> String {
    fields(&result["contents"], "text").join(" ")
}

/// The texts of a `prompts/get` result's messages.
fn prompt_texts(result: &Value) -> String {
    result["messages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["content"]["text"].as_str())
        .collect::<Vec<_>>()
        .join(" ")
}

#[tokio::test]
async fn the_official_clients_list_and_read_resources_and_get_prompts_through_one_url() {
    let env = TestEnv::new("aggregate_surface_one_url");
    let stack = Stack::start(&env).await;
    let etcd = stack.etcd.endpoint();
    let lab = Member::start(&env, &etcd, "orders", "lab-1", &[], 10).await;
    let py = Member::python(&env, &etcd, "py", "py-1", &[], 10).await;
    let _ev = stack.everything(&env, "ev", Some("echo")).await;
    stack
        .wait_healthy("orders", &[&lab], Duration::from_secs(20))
        .await;
    stack
        .wait_healthy("py", &[&py], Duration::from_secs(20))
        .await;
    let url = stack.aggregate_url();
    wait_until(
        "/mcp lists the prompts of both servers that have them",
        Duration::from_secs(20),
        || async {
            let lines = sdk::python(&url, &["initialize", "prompts"]).await;
            let names = lines
                .iter()
                .find(|l| l["step"] == "prompts")
                .map(|l| fields(&l["ok"]["prompts"], "name").join(","))
                .unwrap_or_default();
            names.contains("py__greeting") && names.contains("ev__simple-prompt")
        },
    )
    .await;

    // The official Python SDK, 2025-era with a gateway session (ClientSession).
    let steps = [
        "initialize".to_string(),
        "resources".into(),
        "templates".into(),
        format!("read:{SECRET}"),
        format!("read:{EV_DYNAMIC}"),
        "prompts".into(),
        format!("prompt:py__greeting:{}", json!({"name": "Ada"})),
        "prompt:ev__simple-prompt".into(),
    ];
    let steps: Vec<&str> = steps.iter().map(String::as_str).collect();
    let lines = sdk::python(&url, &steps).await;
    let init = sdk::step_ok(&lines, "initialize");
    assert!(
        init["capabilities"]["resources"].is_object()
            && init["capabilities"]["prompts"].is_object(),
        "initialize does not advertise resources and prompts: {init}"
    );
    let uris = fields(&sdk::step_ok(&lines, "resources")["resources"], "uri");
    assert!(uris.contains(&SECRET), "{uris:?}");
    assert!(
        uris.iter()
            .any(|u| u.starts_with("demo://resource/static/document/")),
        "the everything-server's documents are not listed: {uris:?}"
    );
    let templates = fields(
        &sdk::step_ok(&lines, "templates")["resourceTemplates"],
        "uriTemplate",
    );
    assert!(templates.contains(&EV_TEMPLATE), "{templates:?}");
    let before = py.server.calls("secret_report").await;
    let read = sdk::step_ok(&lines, &format!("read:{SECRET}"));
    assert!(read_texts(read).contains(SECRET_TEXT), "{read}");
    assert_eq!(
        fields(&read["contents"], "uri"),
        [SECRET],
        "the URI as listed"
    );
    let dynamic = sdk::step_ok(&lines, &format!("read:{EV_DYNAMIC}"));
    assert!(
        fields(&dynamic["contents"], "uri").contains(&EV_DYNAMIC),
        "{dynamic}"
    );
    let prompts = fields(&sdk::step_ok(&lines, "prompts")["prompts"], "name");
    for p in ["py__greeting", "ev__simple-prompt", "ev__args-prompt"] {
        assert!(prompts.contains(&p), "{p} not listed: {prompts:?}");
    }
    let greeting = sdk::step_ok(
        &lines,
        &format!("prompt:py__greeting:{}", json!({"name": "Ada"})),
    );
    assert!(
        prompt_texts(greeting).contains("Say hello to Ada."),
        "{greeting}"
    );
    let simple = sdk::step_ok(&lines, "prompt:ev__simple-prompt");
    assert!(!prompt_texts(simple).is_empty(), "{simple}");
    assert!(before >= 1, "the python server counted no read of {SECRET}");

    // A completion goes to the service of the prompt it completes; the log level to every
    // server holding a session for the client (here the everything-server, which the
    // completion made hold one); a subscription to the service of its URI.
    let completing = "complete:ev__completable-prompt:department:Eng";
    let subscribing = format!("subscribe:{EV_DYNAMIC}");
    let unsubscribing = format!("unsubscribe:{EV_DYNAMIC}");
    let lines = sdk::python(
        &url,
        &[
            "initialize",
            completing,
            "set-level:warning",
            &subscribing,
            &unsubscribing,
        ],
    )
    .await;
    let completed = sdk::step_ok(&lines, completing);
    assert_eq!(
        completed["completion"]["values"],
        json!(["Engineering"]),
        "{completed}"
    );
    sdk::step_ok(&lines, "set-level:warning");
    sdk::step_ok(&lines, &subscribing);
    sdk::step_ok(&lines, &unsubscribing);
    // toolgate-xds logs in colour: the escapes go before the line is read.
    let xds_log = std::fs::read_to_string(env.path("xds.log")).unwrap_or_default();
    let mut plain = String::with_capacity(xds_log.len());
    let mut in_escape = false;
    for c in xds_log.chars() {
        match (in_escape, c) {
            (false, '\x1b') => in_escape = true,
            (false, c) => plain.push(c),
            (true, 'm') => in_escape = false,
            (true, _) => {}
        }
    }
    assert!(
        plain
            .lines()
            .any(|l| l.contains("passed a client's log level") && l.contains("servers=1")),
        "the level did not reach the everything-server's session"
    );

    // The Python SDK speaking 2026-07-28 (no sessions): the everything-server speaks only
    // revisions with sessions, so the gateway holds one for this client.
    let lines = sdk::python_in_mode(
        &url,
        "2026-07-28",
        &[
            "initialize",
            "resources",
            &format!("read:{SECRET}"),
            &format!("read:{EV_DYNAMIC}"),
            "prompts",
            "prompt:ev__simple-prompt",
        ],
    )
    .await;
    // Pinned, the SDK asks nothing before its first request: there are no capabilities to
    // look at here (the TypeScript 2.x client below discovers them).
    let init = sdk::step_ok(&lines, "initialize");
    assert_eq!(init["protocolVersion"], "2026-07-28", "{init}");
    assert!(fields(&sdk::step_ok(&lines, "resources")["resources"], "uri").contains(&SECRET));
    assert!(read_texts(sdk::step_ok(&lines, &format!("read:{SECRET}"))).contains(SECRET_TEXT));
    assert!(!read_texts(sdk::step_ok(&lines, &format!("read:{EV_DYNAMIC}"))).is_empty());
    assert!(fields(&sdk::step_ok(&lines, "prompts")["prompts"], "name").contains(&"py__greeting"));
    assert!(!prompt_texts(sdk::step_ok(&lines, "prompt:ev__simple-prompt")).is_empty());

    // The TypeScript SDKs: 1.x as it connects by default, 2.x by default (2026-07-28 when the
    // server offers it) and pinned to 2025-11-25.
    for (sdk, version) in [
        (Sdk::V1, None),
        (Sdk::V2, None),
        (Sdk::V2, Some("2025-11-25")),
    ] {
        let mut client = NodeClient::new(sdk).timeout(Duration::from_secs(30));
        if let Some(v) = version {
            client = client.protocol_version(v);
        }
        let run = client
            .method("resources/list")
            .method("resources/templates/list")
            .step("resources/read", json!({"uri": SECRET}))
            .method("prompts/list")
            .step(
                "prompts/get",
                json!({"name": "py__greeting", "arguments": {"name": "Bo"}}),
            )
            .run(&url)
            .await;
        if run.exit_code != Some(0) {
            env.print_failure_logs();
        }
        let who = format!("{} ({version:?})", run.sdk());
        assert_eq!(
            run.exit_code,
            Some(0),
            "{who}: {}\n{}",
            run.report,
            run.stderr
        );
        let caps = &run.result("connect")["capabilities"];
        assert!(
            caps["resources"].is_object() && caps["prompts"].is_object(),
            "{who}: {caps}"
        );
        assert!(
            fields(&run.result("resources/list")["resources"], "uri").contains(&SECRET),
            "{who}: {}",
            run.report
        );
        assert!(
            fields(
                &run.result("resources/templates/list")["resourceTemplates"],
                "uriTemplate"
            )
            .contains(&EV_TEMPLATE),
            "{who}: {}",
            run.report
        );
        assert!(
            read_texts(run.result("resources/read")).contains(SECRET_TEXT),
            "{who}: {}",
            run.report
        );
        assert!(
            fields(&run.result("prompts/list")["prompts"], "name").contains(&"ev__simple-prompt"),
            "{who}: {}",
            run.report
        );
        assert!(
            prompt_texts(run.result("prompts/get")).contains("Say hello to Bo."),
            "{who}: {}",
            run.report
        );
    }
    let after = py.server.calls("secret_report").await;
    assert!(after >= before + 4, "reads counted: {before} -> {after}");
    drop(lab);
}

#[tokio::test]
async fn two_services_with_the_same_resource_uri_and_prompt_name_are_both_reachable() {
    let env = TestEnv::new("aggregate_surface_collisions");
    let stack = Stack::start(&env).await;
    let etcd = stack.etcd.endpoint();
    // `alpha` registers first: it is the older service, and keeps the bare names.
    let alpha = Member::python(&env, &etcd, "alpha", "alpha-1", &["--links"], 10).await;
    stack
        .wait_healthy("alpha", &[&alpha], Duration::from_secs(20))
        .await;
    let beta = Member::python(&env, &etcd, "beta", "beta-1", &["--links"], 10).await;
    stack
        .wait_healthy("beta", &[&beta], Duration::from_secs(20))
        .await;
    stack
        .admin_put("/v1/virtual/bare", &json!({"naming": "bare"}))
        .await;
    stack
        .admin_put(
            "/v1/virtual/nobeta",
            &json!({"naming": "bare", "exclude": ["beta/greeting"]}),
        )
        .await;
    let url = stack.aggregate_url();
    let bare = url.replace("/mcp", "/virtual/bare");
    let nobeta = url.replace("/mcp", "/virtual/nobeta");
    let beta_uri = format!("toolgate+beta:{SECRET}");
    wait_until(
        "/mcp lists both services' resources",
        Duration::from_secs(20),
        || async {
            let lines = sdk::python(&url, &["initialize", "resources"]).await;
            lines
                .iter()
                .find(|l| l["step"] == "resources")
                .is_some_and(|l| fields(&l["ok"]["resources"], "uri").len() >= 2)
        },
    )
    .await;

    // `/mcp` (prefixed): the prompts by service; the URI kept for the older service and
    // prefixed with `toolgate+beta:` for the other.
    let (a0, b0) = (
        alpha.server.calls("secret_report").await,
        beta.server.calls("secret_report").await,
    );
    let steps = [
        "initialize".to_string(),
        "resources".into(),
        "prompts".into(),
        format!("read:{SECRET}"),
        format!("read:{beta_uri}"),
        format!("prompt:alpha__greeting:{}", json!({"name": "A"})),
        format!("prompt:beta__greeting:{}", json!({"name": "B"})),
        "call:alpha__report_links".into(),
        "call:beta__report_links".into(),
    ];
    let steps: Vec<&str> = steps.iter().map(String::as_str).collect();
    let lines = sdk::python(&url, &steps).await;
    // A tool's resource link and embedded resource carry the URI the resource is listed
    // under, which a read brings back to the service that wrote it.
    for (service, listed) in [("alpha", SECRET), ("beta", beta_uri.as_str())] {
        let result = sdk::step_ok(&lines, &format!("call:{service}__report_links"));
        let content = &result["content"];
        assert_eq!(content[0]["uri"], listed, "{service}: {result}");
        assert_eq!(content[1]["resource"]["uri"], listed, "{service}: {result}");
    }
    let mut uris = fields(&sdk::step_ok(&lines, "resources")["resources"], "uri");
    uris.sort_unstable();
    assert_eq!(uris, [SECRET, beta_uri.as_str()]);
    let mut prompts = fields(&sdk::step_ok(&lines, "prompts")["prompts"], "name");
    prompts.sort_unstable();
    assert_eq!(prompts, ["alpha__greeting", "beta__greeting"]);
    let read = sdk::step_ok(&lines, &format!("read:{beta_uri}"));
    assert!(read_texts(read).contains(SECRET_TEXT), "{read}");
    assert_eq!(
        fields(&read["contents"], "uri"),
        [beta_uri.as_str()],
        "the contents carry the URI as listed"
    );
    assert!(read_texts(sdk::step_ok(&lines, &format!("read:{SECRET}"))).contains(SECRET_TEXT));
    let a = sdk::step_ok(
        &lines,
        &format!("prompt:alpha__greeting:{}", json!({"name": "A"})),
    );
    assert!(prompt_texts(a).contains("Say hello to A."), "{a}");
    let b = sdk::step_ok(
        &lines,
        &format!("prompt:beta__greeting:{}", json!({"name": "B"})),
    );
    assert!(prompt_texts(b).contains("Say hello to B."), "{b}");
    // Each read reached its own service.
    assert_eq!(alpha.server.calls("secret_report").await, a0 + 1);
    assert_eq!(beta.server.calls("secret_report").await, b0 + 1);
    assert_eq!(alpha.server.calls("greeting").await, 1);
    assert_eq!(beta.server.calls("greeting").await, 1);

    // A virtual server with bare names: the older service keeps `greeting`.
    let lines = sdk::python(
        &bare,
        &[
            "initialize",
            "prompts",
            "prompt:greeting",
            "prompt:beta__greeting",
        ],
    )
    .await;
    let mut prompts = fields(&sdk::step_ok(&lines, "prompts")["prompts"], "name");
    prompts.sort_unstable();
    assert_eq!(prompts, ["beta__greeting", "greeting"]);
    sdk::step_ok(&lines, "prompt:greeting");
    sdk::step_ok(&lines, "prompt:beta__greeting");
    assert_eq!(alpha.server.calls("greeting").await, 2);
    assert_eq!(beta.server.calls("greeting").await, 2);

    // Excluded by `<service>/<prompt>`: not listed, and not reachable by its name.
    let lines = sdk::python_with(
        &["--go-on"],
        &nobeta,
        &[
            "initialize",
            "prompts",
            "prompt:beta__greeting",
            "resources",
        ],
    )
    .await;
    assert_eq!(
        fields(&sdk::step_ok(&lines, "prompts")["prompts"], "name"),
        ["greeting"]
    );
    let refused = lines
        .iter()
        .find(|l| l["step"] == "prompt:beta__greeting")
        .expect("a report of the excluded prompt");
    assert_eq!(refused["mcp_error"]["code"], -32602, "{refused}");
    assert_eq!(beta.server.calls("greeting").await, 2, "reached no server");
}
