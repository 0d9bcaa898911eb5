//! What platform teams deploy is what the tests run: the Compose file and the Kubernetes
//! manifests validate offline, every file they mount exists, their Envoy bootstraps are what
//! `toolgate-xds bootstrap` prints, byte for byte, and the images are the versions the tests
//! use; the alerting rules pass promtool (with a unit test of the zombie alert); the Grafana
//! dashboard's queries parse and name metrics toolgate exports; the filter's `.wasm` carries no
//! DWARF.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use toolgate_tests::paths::workspace_root;
use toolgate_tests::{project_bin, tool_bin};

fn root() -> PathBuf {
    workspace_root()
}

/// Runs a command, panicking with its output unless it succeeds; returns stdout.
fn run(what: &str, cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run {cmd:?}: {e} (make setup installs it)"));
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn yaml(text: &str, what: &str) -> Value {
    serde_norway::from_str(text).unwrap_or_else(|e| panic!("{what} is not YAML: {e}"))
}

/// Every YAML document of a file (manifests hold several, separated by `---`).
fn yaml_documents(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    serde_norway::Deserializer::from_str(&text)
        .map(|d| {
            <Value as serde::Deserialize>::deserialize(d)
                .unwrap_or_else(|e| panic!("{path:?} is not YAML: {e}"))
        })
        .filter(|v| !v.is_null())
        .collect()
}

/// `toolgate-xds bootstrap` with the arguments in `args_file` (one per line).
fn render_bootstrap(args_file: &Path) -> String {
    let args: Vec<String> = std::fs::read_to_string(args_file)
        .unwrap_or_else(|e| panic!("{args_file:?}: {e}"))
        .lines()
        .map(str::to_string)
        .collect();
    let mut text = run(
        "toolgate-xds bootstrap",
        Command::new(project_bin("toolgate-xds"))
            .arg("bootstrap")
            .args(&args),
    );
    // What the script writes: the printed bootstrap, with its final newline.
    if !text.ends_with('\n') {
        text.push('\n');
    }
    text
}

fn version_of(tool: &str, args: &[&str], marker: &str) -> String {
    let out = run(tool, Command::new(tool_bin(tool)).args(args));
    let at = out
        .find(marker)
        .unwrap_or_else(|| panic!("{tool} {args:?} does not say {marker:?}: {out}"));
    out[at + marker.len()..]
        .split(char::is_whitespace)
        .find(|s| !s.is_empty())
        .unwrap_or_default()
        .to_string()
}

#[test]
fn deploy_bootstraps_are_what_toolgate_xds_prints() {
    let regenerate = "regenerate with `make deploy-render`";
    let compose = root().join("deploy/compose");
    let rendered = render_bootstrap(&compose.join("bootstrap.args"));
    let committed = std::fs::read_to_string(compose.join("envoy.json")).expect("envoy.json");
    assert!(
        committed == rendered,
        "deploy/compose/envoy.json is not what toolgate-xds bootstrap prints: {regenerate}"
    );

    let k8s = root().join("deploy/kubernetes");
    let rendered = render_bootstrap(&k8s.join("bootstrap.args"));
    let docs = yaml_documents(&k8s.join("envoy-bootstrap.yaml"));
    let configmap = docs
        .iter()
        .find(|d| d["kind"] == "ConfigMap")
        .expect("a ConfigMap");
    assert!(
        configmap["data"]["envoy.json"].as_str() == Some(rendered.as_str()),
        "deploy/kubernetes/envoy-bootstrap.yaml holds another bootstrap than toolgate-xds \
         bootstrap prints: {regenerate}"
    );
    // The bootstraps reach toolgate-xds by service name (Envoy resolves it).
    let b: Value = serde_json::from_str(&rendered).expect("JSON");
    assert_eq!(b["static_resources"]["clusters"][0]["type"], "STRICT_DNS");

    // The Envoy container's preStop hook drains through the admin port of this bootstrap.
    let admin_port = &b["admin"]["address"]["socket_address"]["port_value"];
    let deployment = yaml_documents(&k8s.join("envoy.yaml"))
        .into_iter()
        .find(|d| d["kind"] == "Deployment")
        .expect("envoy.yaml has a Deployment");
    let env = &deployment["spec"]["template"]["spec"]["containers"][0]["env"];
    let hook_port = env
        .as_array()
        .and_then(|vars| vars.iter().find(|v| v["name"] == "ENVOY_ADMIN_PORT"))
        .and_then(|v| v["value"].as_str())
        .expect("the envoy container sets ENVOY_ADMIN_PORT");
    assert_eq!(
        Some(hook_port),
        admin_port.as_u64().map(|p| p.to_string()).as_deref(),
        "ENVOY_ADMIN_PORT in deploy/kubernetes/envoy.yaml is not the bootstrap's admin port"
    );
}

#[test]
fn compose_file_is_valid_and_everything_it_mounts_exists() {
    let file = root().join("deploy/compose/docker-compose.yaml");
    // Debian's docker-compose validates and resolves the file without an engine.
    let config = run(
        "docker-compose config",
        Command::new("docker-compose")
            .arg("-f")
            .arg(&file)
            .arg("config"),
    );
    let config = yaml(&config, "docker-compose config's output");
    let services = config["services"].as_object().expect("services");
    for name in [
        "etcd",
        "toolgate-xds",
        "envoy",
        "inventory-1",
        "finance-1",
        "code-1",
    ] {
        assert!(services.contains_key(name), "no service {name}");
    }
    let mut mounted = Vec::new();
    for (name, svc) in services {
        for v in svc["volumes"].as_array().into_iter().flatten() {
            // docker-compose 1.x prints binds as "source:target[:mode]", named volumes too.
            let spec = v.as_str().unwrap_or_default();
            let source = spec.split(':').next().unwrap_or_default();
            if source.starts_with('/') {
                mounted.push((name.clone(), PathBuf::from(source)));
            }
        }
    }
    for secret in config["secrets"].as_object().into_iter().flatten() {
        let file = secret.1["file"].as_str().unwrap_or_default();
        mounted.push((format!("secret {}", secret.0), PathBuf::from(file)));
    }
    assert!(mounted.len() >= 3, "binds and secrets found: {mounted:?}");
    // The session-sealing key is made at first start in the state volume, never committed:
    // a key in the repository would seal every demo's session ids alike.
    let xds_args: Vec<&str> = services["toolgate-xds"]["command"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    assert!(
        xds_args.iter().any(|a| a.starts_with("--state-dir=")),
        "{xds_args:?}"
    );
    assert!(
        !xds_args.iter().any(|a| a.starts_with("--session-key-file")),
        "the Compose demo takes its session key from the state dir: {xds_args:?}"
    );
    let tracked = run(
        "git ls-files",
        Command::new("git")
            .current_dir(root())
            .args(["ls-files", "deploy/compose"]),
    );
    assert!(
        !tracked.lines().any(|f| f.contains("session-key")),
        "a session key is committed: {tracked}"
    );
    for (who, path) in &mounted {
        assert!(
            path.is_file(),
            "{who} mounts {} which does not exist (make build writes the filter)",
            path.display()
        );
    }

    // The images are the versions the tests run.
    let envoy = version_of("envoy", &["--version"], "version: ");
    let envoy = envoy.split('/').nth(1).unwrap_or(&envoy).to_string();
    let etcd = version_of("etcd", &["--version"], "etcd Version: ");
    let images: BTreeSet<String> = services
        .values()
        .filter_map(|s| s["image"].as_str().map(str::to_string))
        .collect();
    assert!(
        images.contains(&format!("envoyproxy/envoy:v{envoy}")),
        "the Envoy image is not the tested Envoy {envoy}: {images:?}"
    );
    assert!(
        images.contains(&format!("quay.io/coreos/etcd:v{etcd}")),
        "the etcd image is not the tested etcd {etcd}: {images:?}"
    );
}

#[test]
fn images_are_built_from_files_that_exist_and_run_unprivileged() {
    let dockerfile = root().join("deploy/docker/Dockerfile");
    let text = std::fs::read_to_string(&dockerfile).expect("Dockerfile");
    let mut stage = String::new();
    let mut users: Vec<(String, String)> = Vec::new();
    for line in text.lines().map(str::trim) {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["FROM", _, "AS", name] => stage = name.to_string(),
            ["COPY", rest @ ..] if !rest.iter().any(|w| w.starts_with("--from")) => {
                // Sources are relative to the build context, the repository root.
                for src in &rest[..rest.len() - 1] {
                    assert!(
                        root().join(src).exists(),
                        "stage {stage} copies {src}, which is not in the repository"
                    );
                }
            }
            ["USER", user] => users.push((stage.clone(), user.to_string())),
            _ => {}
        }
    }
    for target in [
        "toolgate-xds",
        "toolgate-register",
        "toolgate-demo",
        "toolgate-filter",
    ] {
        let user = users
            .iter()
            .find(|(s, _)| s == target)
            .map(|(_, u)| u.as_str());
        assert!(
            user.is_some_and(|u| !u.starts_with("0") && !u.starts_with("root")),
            "image {target} must name an unprivileged USER, has {user:?}"
        );
    }
}

#[test]
fn kubernetes_manifests_pass_schema_validation_and_run_unprivileged() {
    let dir = root().join("deploy/kubernetes");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("deploy/kubernetes")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 5, "manifests: {files:?}");
    // Schema validation against Kubernetes' OpenAPI schemas, offline (kubernetes-validate
    // bundles them), strict: an unknown field is an error.
    run(
        "kubernetes-validate",
        Command::new(root().join(".venv/bin/kubernetes-validate"))
            .args(["--strict", "--kubernetes-version", "1.33.0"])
            .args(&files),
    );
    let mut pods = 0;
    for file in &files {
        for doc in yaml_documents(file) {
            let Some(spec) = doc["spec"]["template"]["spec"].as_object() else {
                continue;
            };
            pods += 1;
            let name = doc["metadata"]["name"].as_str().unwrap_or_default();
            assert_eq!(
                spec["securityContext"]["runAsNonRoot"], true,
                "{name} ({file:?}) must run as non-root"
            );
            for c in spec["containers"].as_array().into_iter().flatten().chain(
                spec.get("initContainers")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten(),
            ) {
                assert_eq!(
                    c["securityContext"]["allowPrivilegeEscalation"], false,
                    "{name}/{} may escalate privileges",
                    c["name"]
                );
            }
        }
    }
    assert!(pods >= 4, "pod templates found: {pods}");
}

fn promtool() -> Command {
    Command::new("promtool")
}

#[test]
fn alerting_rules_pass_promtool_and_the_zombie_alert_unit_test() {
    let dir = root().join("deploy/prometheus");
    run(
        "promtool check rules",
        promtool()
            .args(["check", "rules"])
            .arg(dir.join("toolgate-alerts.yaml")),
    );
    let out = run(
        "promtool test rules",
        promtool()
            .args(["test", "rules"])
            .arg(dir.join("toolgate-alerts.test.yaml")),
    );
    assert!(out.contains("SUCCESS"), "promtool test rules: {out}");
}

/// Metric names toolgate exports: toolgate-xds's (registered in metrics.rs; counters get
/// `_total`, histograms `_bucket`) and the filter's per-tool stats in Envoy.
fn exported_metrics() -> BTreeSet<String> {
    let source =
        std::fs::read_to_string(root().join("xds-server/src/metrics.rs")).expect("metrics.rs");
    let mut names = BTreeSet::new();
    let mut rest = source.as_str();
    while let Some(at) = rest.find("registry.register(") {
        rest = &rest[at..];
        if let Some(q) = rest.find('"') {
            let name: String = rest[q + 1..].chars().take_while(|c| *c != '"').collect();
            for suffix in ["", "_total", "_bucket", "_sum", "_count"] {
                names.insert(format!("{name}{suffix}"));
            }
        }
        rest = &rest[1..];
    }
    for kind in ["calls", "failures", "slow", "rejected", "state"] {
        names.insert(format!("toolgate_{kind}"));
    }
    names.insert("up".into());
    names
}

#[test]
fn dashboard_queries_parse_and_name_exported_metrics() {
    let path = root().join("deploy/grafana/toolgate-dashboard.json");
    let dashboard: Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("dashboard")).expect("JSON");
    let mut exprs = Vec::new();
    for p in dashboard["panels"].as_array().expect("panels") {
        for t in p["targets"].as_array().into_iter().flatten() {
            if let Some(e) = t["expr"].as_str() {
                exprs.push((
                    p["title"].as_str().unwrap_or_default().to_string(),
                    e.to_string(),
                ));
            }
        }
    }
    assert!(exprs.len() >= 15, "queries: {}", exprs.len());

    // Every metric a query names is one toolgate exports (an identifier before `{`, `[` or
    // `)` that is not a PromQL function or keyword).
    let known = exported_metrics();
    let keywords = [
        "sum",
        "max",
        "min",
        "by",
        "rate",
        "increase",
        "histogram_quantile",
        "le",
    ];
    for (title, expr) in &exprs {
        let mut word = String::new();
        let mut in_braces = false;
        for c in expr.chars().chain(std::iter::once(' ')) {
            if c.is_ascii_alphanumeric() || c == '_' {
                word.push(c);
                continue;
            }
            if !word.is_empty()
                && !in_braces
                && word.contains('_')
                && !keywords.contains(&word.as_str())
                && !word.starts_with("__")
            {
                assert!(
                    known.contains(&word),
                    "panel {title:?} queries {word}, which toolgate does not export"
                );
            }
            word.clear();
            match c {
                '{' => in_braces = true,
                '}' => in_braces = false,
                _ => {}
            }
        }
    }

    // promtool parses each query (as a recording rule), with Grafana's variables filled in.
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (i, (_, expr)) in exprs.iter().enumerate() {
        let expr = expr
            .replace("$__rate_interval", "5m")
            .replace("$service", ".*");
        rules.push_str(&format!(
            "      - record: dashboard:query{i}\n        expr: {}\n",
            serde_json::to_string(&expr).expect("quoting")
        ));
    }
    let dir = std::env::temp_dir().join(format!("toolgate-dashboard-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let file = dir.join("queries.yaml");
    std::fs::write(&file, rules).expect("writing the queries");
    let checked = promtool().args(["check", "rules"]).arg(&file).output();
    let _ = std::fs::remove_dir_all(&dir);
    let out = checked.expect("promtool (make setup installs it)");
    assert!(
        out.status.success(),
        "promtool refused a dashboard query:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_configuration_reference_is_current() {
    let out = std::env::temp_dir().join(format!("toolgate-reference-{}.md", std::process::id()));
    run(
        "scripts/render-reference.sh",
        Command::new("bash")
            .arg(root().join("scripts/render-reference.sh"))
            .arg(&out)
            .env("BIN", root().join("target/release")),
    );
    let rendered = std::fs::read_to_string(&out).expect("the rendered reference");
    let _ = std::fs::remove_file(&out);
    let committed = std::fs::read_to_string(root().join("docs/src/reference/flags.md"))
        .expect("docs/src/reference/flags.md");
    assert!(
        committed == rendered,
        "docs/src/reference/flags.md is not what the programs say: run scripts/render-reference.sh"
    );
    for flag in [
        "--report-token-file",
        "--ready-listen",
        "--etcd-ca",
        "failure_rate",
    ] {
        assert!(rendered.contains(flag), "the reference lacks {flag}");
    }
}

/// The custom sections of a wasm module, by name and size, in file order.
fn wasm_custom_sections(module: &[u8]) -> Vec<(String, usize)> {
    fn leb(bytes: &[u8], at: &mut usize) -> usize {
        let (mut value, mut shift) = (0usize, 0);
        loop {
            let byte = *bytes
                .get(*at)
                .unwrap_or_else(|| panic!("truncated LEB128 at byte {at}"));
            *at += 1;
            value |= usize::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return value;
            }
            shift += 7;
            assert!(shift < 64, "LEB128 too long at byte {at}");
        }
    }
    assert!(
        module.starts_with(b"\0asm"),
        "not a wasm module (magic {:?})",
        &module[..module.len().min(4)]
    );
    let (mut at, mut custom) = (8, Vec::new());
    while at < module.len() {
        let id = module[at];
        at += 1;
        let size = leb(module, &mut at);
        let end = at + size;
        assert!(end <= module.len(), "section {id} runs past the file's end");
        if id == 0 {
            let mut name_at = at;
            let len = leb(module, &mut name_at);
            let name = String::from_utf8_lossy(&module[name_at..name_at + len]).into_owned();
            custom.push((name, size));
        }
        at = end;
    }
    custom
}

/// Envoy reads and hashes (SHA-256, in portable C++) the whole `.wasm` again on every ECDS
/// update, which comes with every fleet opening and policy change. The standard library's own
/// DWARF made 4.2 of the file's 5.2 MB and 10-20 ms of each update; the release profile strips
/// it (`strip = "debuginfo"` in Cargo.toml).
#[test]
fn the_filter_ships_without_debug_sections() {
    let path = toolgate_tests::filter_wasm();
    let module = std::fs::read(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    let custom = wasm_custom_sections(&module);
    let debug: Vec<&(String, usize)> = custom
        .iter()
        .filter(|(name, _)| name.starts_with(".debug"))
        .collect();
    assert!(
        debug.is_empty(),
        "{path:?} carries DWARF that V8 ignores and Envoy hashes on every update: {debug:?}"
    );
    assert!(
        custom.iter().any(|(name, _)| name == "name"),
        "{path:?} lost its `name` section, which names the functions of a wasm panic's \
         backtrace in Envoy's log; sections: {custom:?}"
    );
}
