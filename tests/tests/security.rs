//! A secured etcd: client-certificate TLS and authentication on, with the least-privilege
//! users and roles of `scripts/etcd-roles.sh`. toolgate-xds and toolgate-register reach it with
//! `--etcd-ca/--etcd-cert/--etcd-key` and a user whose password comes from a file or the
//! environment; a registrar of one service cannot register under another, and toolgate-xds
//! cannot write registrations. Certificates are generated for the test with rcgen.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use etcd_client::{Certificate, Client, ConnectOptions, Identity, TlsOptions};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair,
};
use toolgate_tests::{
    free_port, parse_metric, project_bin, tool_bin, wait_for, wait_until, McpServer, Proc, TestEnv,
    Xds,
};

const SERVICES: &[&str] = &["finance", "inventory"];

/// A CA and certificates it signed, written as PEM files into the test's directory.
struct Pki {
    dir: PathBuf,
}

impl Pki {
    fn new(env: &TestEnv, names: &[&str]) -> Pki {
        Self::named(env, "pki", names)
    }

    /// Another, unrelated CA in `<test dir>/<dir>`.
    fn named(env: &TestEnv, dir: &str, names: &[&str]) -> Pki {
        let dir = env.path(dir);
        std::fs::create_dir_all(&dir).expect("pki dir");
        let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name
            .push(DnType::CommonName, "toolgate test CA");
        let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().expect("CA key"))
            .expect("CA certificate");
        std::fs::write(dir.join("ca.pem"), ca.pem()).expect("write CA");
        for name in names {
            // The server certificate names the loopback address; client certificates carry the
            // etcd user as their common name.
            let mut params =
                CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])
                    .expect("params");
            params.distinguished_name.push(DnType::CommonName, *name);
            params.extended_key_usages = vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ];
            let key = KeyPair::generate().expect("key");
            let cert = params.signed_by(&key, &ca).expect("sign");
            std::fs::write(dir.join(format!("{name}.pem")), cert.pem()).expect("write cert");
            std::fs::write(dir.join(format!("{name}-key.pem")), key.serialize_pem())
                .expect("write key");
        }
        Pki { dir }
    }

    fn path(&self, file: &str) -> String {
        self.dir.join(file).to_string_lossy().into_owned()
    }

    fn cert(&self, name: &str) -> String {
        self.path(&format!("{name}.pem"))
    }

    fn key(&self, name: &str) -> String {
        self.path(&format!("{name}-key.pem"))
    }

    /// The TLS flags of toolgate-xds and toolgate-register for the identity `name`.
    fn flags(&self, name: &str) -> Vec<String> {
        vec![
            "--etcd-ca".into(),
            self.path("ca.pem"),
            "--etcd-cert".into(),
            self.cert(name),
            "--etcd-key".into(),
            self.key(name),
        ]
    }

    fn tls(&self, name: &str) -> TlsOptions {
        let read = |p: String| std::fs::read(&p).unwrap_or_else(|e| panic!("{p}: {e}"));
        TlsOptions::new()
            .ca_certificate(Certificate::from_pem(read(self.path("ca.pem"))))
            .identity(Identity::from_pem(
                read(self.cert(name)),
                read(self.key(name)),
            ))
    }
}

struct SecureEtcd {
    endpoint: String,
    _proc: Proc,
}

impl SecureEtcd {
    async fn start(env: &TestEnv, pki: &Pki) -> SecureEtcd {
        let (client, peer) = (free_port(), free_port());
        let endpoint = format!("https://127.0.0.1:{client}");
        let args: Vec<String> = vec![
            "--name".into(),
            "secure".into(),
            "--data-dir".into(),
            env.path("etcd.data").to_string_lossy().into_owned(),
            "--listen-client-urls".into(),
            endpoint.clone(),
            "--advertise-client-urls".into(),
            endpoint.clone(),
            "--listen-peer-urls".into(),
            format!("http://127.0.0.1:{peer}"),
            "--initial-advertise-peer-urls".into(),
            format!("http://127.0.0.1:{peer}"),
            "--initial-cluster".into(),
            format!("secure=http://127.0.0.1:{peer}"),
            "--cert-file".into(),
            pki.cert("etcd-server"),
            "--key-file".into(),
            pki.key("etcd-server"),
            "--trusted-ca-file".into(),
            pki.path("ca.pem"),
            "--client-cert-auth".into(),
        ];
        let proc = env.spawn("etcd", &tool_bin("etcd"), &args);
        let etcd = SecureEtcd {
            endpoint,
            _proc: proc,
        };
        wait_until("TLS etcd answers", Duration::from_secs(20), || async {
            match etcd.client(pki, "root", None).await {
                Ok(mut c) => c.status().await.is_ok(),
                Err(_) => false,
            }
        })
        .await;
        etcd
    }

    async fn client(
        &self,
        pki: &Pki,
        cert: &str,
        user: Option<(&str, &str)>,
    ) -> Result<Client, etcd_client::Error> {
        let mut opts = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(2))
            .with_timeout(Duration::from_secs(5))
            .with_tls(pki.tls(cert));
        if let Some((u, p)) = user {
            opts = opts.with_user(u, p);
        }
        Client::connect([self.endpoint.as_str()], Some(opts)).await
    }

    /// `etcdctl` with the root identity (client certificate and password).
    fn etcdctl_env(&self, pki: &Pki) -> Vec<(String, String)> {
        vec![
            ("ETCDCTL_API".into(), "3".into()),
            ("ETCDCTL_ENDPOINTS".into(), self.endpoint.clone()),
            ("ETCDCTL_CACERT".into(), pki.path("ca.pem")),
            ("ETCDCTL_CERT".into(), pki.cert("root")),
            ("ETCDCTL_KEY".into(), pki.key("root")),
            (
                "ETCDCTL".into(),
                tool_bin("etcdctl").to_string_lossy().into_owned(),
            ),
        ]
    }
}

fn passwords(env: &TestEnv) -> PathBuf {
    let dir = env.path("passwords");
    std::fs::create_dir_all(&dir).expect("password dir");
    for user in [
        "root",
        "toolgate-xds",
        "registrar-finance",
        "registrar-inventory",
    ] {
        std::fs::write(dir.join(user), format!("pw-of-{user}\n")).expect("password");
    }
    dir
}

fn roles_script() -> PathBuf {
    toolgate_tests::paths::workspace_root().join("scripts/etcd-roles.sh")
}

/// Runs toolgate-register to completion (it exits when refused) or until `timeout`.
async fn registrar(
    env: &TestEnv,
    name: &str,
    args: Vec<String>,
    envs: &[(String, String)],
) -> Proc {
    env.spawn_with_env(name, &project_bin("toolgate-register"), &args, envs)
}

fn register_args(
    etcd: &SecureEtcd,
    pki: &Pki,
    service: &str,
    id: &str,
    endpoint: &str,
    user: &str,
) -> Vec<String> {
    let mut args = vec![
        "--etcd".to_string(),
        etcd.endpoint.clone(),
        "--service".into(),
        service.into(),
        "--instance-id".into(),
        id.into(),
        "--endpoint".into(),
        endpoint.into(),
        "--tools".into(),
        "echo".into(),
        "--etcd-user".into(),
        user.into(),
        "--etcd-password-env".into(),
        "TG_ETCD_PASSWORD".into(),
    ];
    args.extend(pki.flags(user));
    args
}

#[tokio::test]
async fn a_secured_etcd_admits_each_program_only_where_its_role_allows() {
    let env = TestEnv::new("security_etcd");
    let pki = Pki::new(
        &env,
        &[
            "etcd-server",
            "root",
            "toolgate-xds",
            "registrar-finance",
            "registrar-inventory",
        ],
    );
    let etcd = SecureEtcd::start(&env, &pki).await;
    let pw = passwords(&env);

    // The documented role layout, applied by the documented script.
    let out = Command::new("bash")
        .arg(roles_script())
        .arg(&pw)
        .args(SERVICES)
        .envs(etcd.etcdctl_env(&pki))
        .env("ETCDCTL_USER", "root:pw-of-root")
        .output()
        .expect("running etcd-roles.sh");
    assert!(
        out.status.success(),
        "etcd-roles.sh failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // Auth is on: a client with a certificate but a wrong password is refused.
    let wrong = etcd
        .client(&pki, "toolgate-xds", Some(("toolgate-xds", "wrong")))
        .await;
    assert!(wrong.is_err(), "a wrong password must not log in");

    // toolgate-xds with its own identity; its password from a file.
    let mut xds_args = vec![
        "--etcd-user".to_string(),
        "toolgate-xds".into(),
        "--etcd-password-file".into(),
        pw.join("toolgate-xds").to_string_lossy().into_owned(),
        "--admin-token-env".into(),
        "TG_ADMIN".into(),
        "--allowed-cidrs".into(),
        "127.0.0.0/8".into(),
    ];
    xds_args.extend(pki.flags("toolgate-xds"));
    let xds_args: Vec<&str> = xds_args.iter().map(String::as_str).collect();
    let xds = Xds::start_with_env(
        &env,
        "xds",
        &etcd.endpoint,
        &xds_args,
        &[("TG_ADMIN", "admin-token")],
    )
    .await;

    // The finance registrar registers a finance instance; toolgate-xds reads it.
    let server = McpServer::lab(&env, "fin-1", &[]).await;
    let finance_env = [(
        "TG_ETCD_PASSWORD".to_string(),
        "pw-of-registrar-finance".to_string(),
    )];
    let _finance = registrar(
        &env,
        "fin-1.registrar",
        register_args(
            &etcd,
            &pki,
            "finance",
            "fin-1",
            &server.endpoint(),
            "registrar-finance",
        ),
        &finance_env,
    )
    .await;
    let (registry, _) = wait_for(
        "toolgate-xds sees fin-1",
        Duration::from_secs(15),
        || async {
            let r = xds.registry().await;
            r.to_string().contains("fin-1").then_some(r)
        },
    )
    .await;
    assert_eq!(registry["etcd_up"], true, "{registry}");
    // Its role lets it join the fleet's toolgate-xds (its admin listener under `xds/`).
    wait_until(
        "toolgate-xds registers itself in the fleet",
        Duration::from_secs(15),
        || async {
            xds.log()
                .contains("registered this toolgate-xds in the fleet")
        },
    )
    .await;

    // The same registrar identity under another service: refused by etcd, said, exit 2.
    let mut intruder = registrar(
        &env,
        "intruder.registrar",
        register_args(
            &etcd,
            &pki,
            "inventory",
            "inv-x",
            &server.endpoint(),
            "registrar-finance",
        ),
        &finance_env,
    )
    .await;
    let status = intruder
        .wait_exit(Duration::from_secs(15))
        .await
        .expect("a refused registrar exits");
    let log = intruder.log();
    assert_eq!(status.code(), Some(2), "{log}");
    assert!(
        log.contains(
            "etcd refused writing /mcp/services/inventory/inv-x as etcd user registrar-finance"
        ) && log.contains("permission denied"),
        "the refusal names the key, the user and etcd's reason:\n{log}"
    );
    let mut root = etcd
        .client(&pki, "root", Some(("root", "pw-of-root")))
        .await
        .expect("root client");
    let inventory = root
        .get(
            "/mcp/services/inventory/",
            Some(etcd_client::GetOptions::new().with_prefix()),
        )
        .await
        .expect("get");
    assert!(
        inventory.kvs().is_empty(),
        "nothing was written under inventory"
    );

    // toolgate-xds writes what its role allows (an override) and nothing else.
    let resp = reqwest::Client::new()
        .put(format!("{}/v1/overrides/finance/echo", xds.admin_url()))
        .bearer_auth("admin-token")
        .body(r#"{"mode":"force_open","reason":"security test"}"#)
        .send()
        .await
        .expect("PUT override");
    assert_eq!(resp.status(), 200, "{:?}", resp.text().await);
    let mut as_xds = etcd
        .client(
            &pki,
            "toolgate-xds",
            Some(("toolgate-xds", "pw-of-toolgate-xds")),
        )
        .await
        .expect("toolgate-xds client");
    let err = as_xds
        .put(
            "/mcp/services/finance/forged",
            r#"{"instance_id":"forged","endpoint":"127.0.0.1:1"}"#,
            None,
        )
        .await
        .expect_err("toolgate-xds must not write registrations");
    assert!(err.to_string().contains("permission denied"), "{err}");

    // Whoever can write a registration cannot aim it at the metadata service, or outside the
    // allowed networks: refused with its key, counted, never routed.
    for (id, endpoint) in [("meta", "169.254.169.254:80"), ("outside", "10.1.2.3:8080")] {
        root.put(
            format!("/mcp/services/finance/{id}"),
            format!(r#"{{"instance_id":"{id}","endpoint":"{endpoint}"}}"#),
            None,
        )
        .await
        .expect("root writes a rogue registration");
    }
    let (metrics, _) = wait_for("both refused", Duration::from_secs(10), || async {
        let m = xds.metrics_text().await;
        (parse_metric(
            &m,
            "toolgate_registry_invalid_values_total",
            r#"reason="refused_endpoint""#,
        ) >= 2.0)
            .then_some(m)
    })
    .await;
    let registry = xds.registry().await.to_string();
    assert!(
        !registry.contains("169.254") && !registry.contains("10.1.2.3"),
        "refused endpoints are never in the registry: {registry}\n{metrics}"
    );
    let log = xds.log();
    assert!(
        log.contains("/mcp/services/finance/meta") && log.contains("link-local"),
        "the refusal is logged with its key and why"
    );
    assert!(log.contains("outside the allowed networks (127.0.0.0/8)"));

    // A toolgate-xds with a wrong password keeps running (etcd_up 0) and says why.
    let wrong_pw = env.path("wrong-password");
    std::fs::write(&wrong_pw, "not-the-password\n").expect("write");
    let mut wrong_args = vec![
        "--etcd-user".to_string(),
        "toolgate-xds".into(),
        "--etcd-password-file".into(),
        wrong_pw.to_string_lossy().into_owned(),
    ];
    wrong_args.extend(pki.flags("toolgate-xds"));
    let wrong_args: Vec<&str> = wrong_args.iter().map(String::as_str).collect();
    let refused = Xds::start(&env, "xds-wrong-password", &etcd.endpoint, &wrong_args).await;
    wait_until(
        "the refused login is logged",
        Duration::from_secs(10),
        || async { refused.log().contains("authentication failed") },
    )
    .await;
    assert_eq!(refused.registry().await["etcd_up"], false);

    // Plain HTTP to a TLS etcd gets nowhere.
    let status = Command::new(project_bin("toolgate-register"))
        .args([
            "--etcd",
            &etcd.endpoint.replace("https://", "http://"),
            "--service",
            "finance",
        ])
        .args(["--endpoint", "127.0.0.1:1", "--etcd-timeout", "1s"])
        .output()
        .expect("run");
    assert!(!status.status.success(), "plain HTTP must fail");
}

#[tokio::test]
async fn reads_of_the_admin_api_can_need_the_admin_token() {
    let env = TestEnv::new("security_reads");
    let etcd = toolgate_tests::Etcd::start(&env).await;
    let xds = Xds::start_with_env(
        &env,
        "xds",
        &etcd.endpoint(),
        &["--admin-token-env", "TG_ADMIN", "--protect-reads"],
        &[("TG_ADMIN", "read-token")],
    )
    .await;
    let http = reqwest::Client::new();
    let get = |path: &str, token: Option<&str>| {
        let mut r = http.get(format!("{}{path}", xds.admin_url()));
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        async move {
            let resp = r.send().await.expect("GET");
            (
                resp.status().as_u16(),
                resp.text().await.unwrap_or_default(),
            )
        }
    };
    for path in [
        "/v1/registry",
        "/v1/breakers",
        "/v1/overrides",
        "/v1/envoys",
        "/metrics",
    ] {
        let (status, body) = get(path, None).await;
        assert_eq!(status, 401, "{path}: {body}");
        assert!(body.contains("--protect-reads"), "{path} says why: {body}");
        assert_eq!(get(path, Some("wrong")).await.0, 403, "{path}");
        assert_eq!(get(path, Some("read-token")).await.0, 200, "{path}");
    }
    assert_eq!(get("/healthz", None).await.0, 200, "liveness stays open");
    assert_eq!(
        get("/ui/", None).await.0,
        200,
        "the console page stays open"
    );

    let status = |token: Option<&str>| {
        let mut c = Command::new(project_bin("toolgate-xds"));
        c.args(["status", "--admin", &xds.admin_url()]);
        if let Some(t) = token {
            c.args(["--admin-token-env", "TG_STATUS_TOKEN"])
                .env("TG_STATUS_TOKEN", t);
        }
        c.output().expect("toolgate-xds status")
    };
    let refused = status(None);
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("401"));
    let ok = status(Some("read-token"));
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(String::from_utf8_lossy(&ok.stdout).contains("etcd reachable"));
}

#[tokio::test]
async fn ads_with_mutual_tls_serves_only_envoys_with_a_certificate_from_its_ca() {
    let env = TestEnv::new("security_ads_mtls");
    let pki = Pki::new(&env, &["toolgate-xds", "envoy-good"]);
    let rogue = Pki::named(&env, "rogue-pki", &["envoy-rogue"]);
    let etcd = toolgate_tests::Etcd::start(&env).await;
    let (cert, key, ca) = (
        pki.cert("toolgate-xds"),
        pki.key("toolgate-xds"),
        pki.path("ca.pem"),
    );
    let xds = Xds::start(
        &env,
        "xds",
        &etcd.endpoint(),
        &[
            "--xds-tls-cert",
            &cert,
            "--xds-tls-key",
            &key,
            "--xds-tls-client-ca",
            &ca,
        ],
    )
    .await;
    let member =
        toolgate_tests::Member::start(&env, &etcd.endpoint(), "orders", "orders-1", &[], 10).await;

    let (good_cert, good_key) = (pki.cert("envoy-good"), pki.key("envoy-good"));
    let good = toolgate_tests::Envoy::start_with(
        &env,
        "envoy-good",
        &xds,
        1,
        &[
            "--xds-tls-ca",
            &ca,
            "--xds-tls-cert",
            &good_cert,
            "--xds-tls-key",
            &good_key,
        ],
    )
    .await;
    let want = vec![member.server.endpoint()];
    wait_until(
        "the mTLS Envoy routes orders",
        Duration::from_secs(20),
        || async { good.addresses("orders").await == want },
    )
    .await;

    // An Envoy whose certificate another CA signed trusts toolgate-xds but is not trusted back.
    let (rogue_cert, rogue_key) = (rogue.cert("envoy-rogue"), rogue.key("envoy-rogue"));
    let bad = toolgate_tests::Envoy::start_unconfigured(
        &env,
        "envoy-rogue",
        &xds,
        &[
            "--xds-tls-ca",
            &ca,
            "--xds-tls-cert",
            &rogue_cert,
            "--xds-tls-key",
            &rogue_key,
        ],
    )
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_ne!(
        bad.readiness().await,
        "LIVE",
        "the rogue Envoy got no configuration"
    );
    assert!(
        bad.addresses("orders").await.is_empty(),
        "the rogue Envoy has no route"
    );
    let envoys = reqwest::get(format!("{}/v1/envoys", xds.admin_url()))
        .await
        .expect("GET /v1/envoys")
        .text()
        .await
        .unwrap_or_default();
    assert!(
        envoys.contains("envoy-good") && !envoys.contains("envoy-rogue"),
        "{envoys}"
    );

    // Plain HTTP to the ADS port does not even get an answer.
    let plain = reqwest::Client::new()
        .get(format!("http://{}/", xds.xds_addr()))
        .timeout(Duration::from_secs(2))
        .send()
        .await;
    assert!(plain.is_err(), "plaintext must fail: {plain:?}");
}

#[tokio::test]
async fn the_filters_reports_need_the_report_token() {
    let env = TestEnv::new("security_reports");
    let etcd = toolgate_tests::Etcd::start(&env).await;
    let xds = Xds::start_with_env(
        &env,
        "xds",
        &etcd.endpoint(),
        &["--report-token-env", "TG_REPORT"],
        &[("TG_REPORT", "report-secret")],
    )
    .await;
    let envoy = toolgate_tests::Envoy::start_with_filter(&env, "envoy", &xds, 1, &[]).await;
    let member =
        toolgate_tests::Member::start(&env, &etcd.endpoint(), "orders", "orders-1", &[], 10).await;
    toolgate_tests::wait_until(
        "envoy routes to orders-1",
        Duration::from_secs(20),
        || async { envoy.addresses("orders").await == vec![member.server.endpoint()] },
    )
    .await;

    // A forged report is refused before its body is read.
    let http = reqwest::Client::new();
    for path in ["/v1/feedback", "/v1/breaker-events"] {
        let post = |token: Option<&str>| {
            let mut r = http
                .post(format!("{}{path}", xds.admin_url()))
                .header("content-type", "application/json")
                .body("{}");
            if let Some(t) = token {
                r = r.bearer_auth(t);
            }
            async move {
                let resp = r.send().await.expect("POST");
                (
                    resp.status().as_u16(),
                    resp.text().await.unwrap_or_default(),
                )
            }
        };
        let (status, body) = post(None).await;
        assert_eq!(status, 401, "{path} without a token: {body}");
        assert!(body.contains("report token"), "{path} says why: {body}");
        assert_eq!(
            post(Some("guess")).await.0,
            403,
            "{path} with a wrong token"
        );
    }

    // The filter got the token over ADS: its call reports are taken, so the calls show up in
    // the registry's counts. The calls race the configuration change that brings the tools'
    // definitions (toolgate-xds reads them as the service registers); it replaces the
    // filter's root contexts, and the counts not posted yet must survive it.
    let mut agent = toolgate_tests::McpSession::connect(&envoy.url("orders")).await;
    for n in 0..3 {
        let reply = agent
            .call_tool("read_order", serde_json::json!({"order": n}))
            .await;
        assert!(reply.text().contains("orders-1"), "{}", reply.body);
    }
    toolgate_tests::wait_until(
        "toolgate-xds counts the calls the filter reported",
        Duration::from_secs(15),
        || async {
            xds.registry().await["services"]["orders"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|i| i["calls"]["ok"].as_u64().unwrap_or(0) >= 3)
        },
    )
    .await;
    assert!(
        !envoy
            .proc
            .as_ref()
            .map(|p| p.log())
            .unwrap_or_default()
            .contains("answered call feedback with HTTP 401"),
        "the filter's reports were refused"
    );
}
