//! `toolgate-dev-issuer`: a local OAuth issuer for trying issue 20's resource server against
//! `make demo` (never for production: its keys live in memory and it signs whatever it is
//! asked). It serves a JWKS on 127.0.0.1, turns the gateway's auth on through toolgate-xds's
//! admin API (every service requires a token; `finance`'s `tax_calc` is for role
//! `accountant` alone), prints tokens to try, and serves until Ctrl-C, then turns auth off.
//! Its token endpoint exchanges tokens (RFC 8693) for one client, `toolgate-gateway`, whose
//! secret it writes to a file for the gateway to read.

use std::time::Duration;

use anyhow::{bail, Context};
use clap::Parser;
use serde_json::json;
use toolgate_tests::Issuer;

#[derive(Parser)]
#[command(about = "A local OAuth issuer for trying the gateway's token checks with `make demo`")]
struct Args {
    /// toolgate-xds's admin API.
    #[arg(long, default_value = "http://127.0.0.1:19000")]
    admin: String,
    /// The file holding the admin token (`make demo` prints where).
    #[arg(long)]
    admin_token_file: std::path::PathBuf,
    /// The gateway's public base URL: the resource tokens are issued for.
    #[arg(long, default_value = "http://127.0.0.1:10000")]
    gateway: String,
    /// Where to write the secret of the token endpoint's client `toolgate-gateway`, fresh at
    /// every start [default: dev-issuer-client-secret beside the admin token file].
    #[arg(long)]
    client_secret_file: Option<std::path::PathBuf>,
}

/// The audience inventory's exchanged tokens are issued for.
const EXCHANGE_AUDIENCE: &str = "urn:toolgate:demo:inventory";
/// The client the demo's gateway exchanges tokens as.
const CLIENT_ID: &str = "toolgate-gateway";

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let token = std::fs::read_to_string(&args.admin_token_file)
        .with_context(|| format!("reading {}", args.admin_token_file.display()))?;
    let token = token.trim();
    let issuer = Issuer::start().await;
    let secret_file = args.client_secret_file.clone().unwrap_or_else(|| {
        let dir = args
            .admin_token_file
            .parent()
            .unwrap_or(std::path::Path::new(""));
        dir.join("dev-issuer-client-secret")
    });
    let secret = format!("{:032x}", rand::random::<u128>());
    write_secret(&secret_file, &secret)
        .with_context(|| format!("writing {}", secret_file.display()))?;
    issuer.register_client(CLIENT_ID, &secret);
    let gateway = args.gateway.trim_end_matches('/');
    let http = reqwest::Client::new();
    let put = |path: &str, body: serde_json::Value| {
        http.put(format!("{}{path}", args.admin))
            .bearer_auth(token)
            .json(&body)
            .send()
    };
    let config = json!({
        "resource": gateway,
        "authorization_servers": [issuer.issuer()],
        "scopes_supported": ["tools:call"],
        "issuers": [{"issuer": issuer.issuer(),
                     "jwks": {"remote": {"uri": issuer.jwks_uri(), "cache_secs": 60}}}],
        "required": ["*"]
    });
    let resp = put("/v1/auth/config", config).await?;
    if !resp.status().is_success() {
        bail!(
            "toolgate-xds refused the auth configuration: {}",
            resp.text().await?
        );
    }
    let rules = json!({"rules": [{"tools": ["tax_calc"], "roles": ["accountant"]}]});
    let resp = put("/v1/auth/rules/finance", rules).await?;
    if !resp.status().is_success() {
        bail!("toolgate-xds refused the rules: {}", resp.text().await?);
    }
    // inventory's servers get each caller's own token, exchanged here for their audience.
    let exchange = json!({"exchange": {
        "token_endpoint": issuer.token_endpoint(),
        "audience": EXCHANGE_AUDIENCE,
        "scopes": ["tools:call"],
        "client": {"id": CLIENT_ID, "secret": format!("file:{}", secret_file.display())}
    }});
    let resp = put("/v1/auth/upstream/inventory", exchange).await?;
    if !resp.status().is_success() {
        bail!(
            "toolgate-xds refused the token exchange: {}",
            resp.text().await?
        );
    }
    let week = Duration::from_secs(7 * 24 * 3600);
    let agent = issuer
        .token()
        .sub("agent-1")
        .aud(gateway)
        .scope("tools:call")
        .expires_in(week)
        .sign();
    let accountant = issuer
        .token()
        .sub("alice")
        .aud(gateway)
        .roles(["accountant"])
        .expires_in(week)
        .sign();
    println!(
        "issuer {} (JWKS {}); auth is on for every service of {gateway}.\n\
         Token exchange (RFC 8693) at {}: client {CLIENT_ID}, its secret in {}; inventory's\n\
         servers get each caller's token exchanged for {EXCHANGE_AUDIENCE}.\n\n\
         No token: 401 naming the metadata\n  \
         curl -si {gateway}/mcp/finance -d '{{}}' | grep -i www-authenticate\n  \
         curl -s {gateway}/.well-known/oauth-protected-resource/mcp/finance\n\n\
         An agent (any tool of inventory and code; not finance's tax_calc):\n  \
         export TOKEN={agent}\n  \
         scripts/mcp-call.sh {gateway}/mcp/code ast_parse '{{\"source\":\"fn main() {{}}\"}}'\n  \
         scripts/mcp-call.sh {gateway}/mcp/finance tax_calc '{{\"amount\":100,\"region\":\"de\"}}'   # refused: tool_denied\n\n\
         An accountant (role accountant: finance's tax_calc, and the rest):\n  \
         export TOKEN={accountant}\n  \
         scripts/mcp-call.sh {gateway}/mcp/finance tax_calc '{{\"amount\":100,\"region\":\"de\"}}'\n\n\
         Ctrl-C turns auth off again.",
        issuer.issuer(),
        issuer.jwks_uri(),
        issuer.token_endpoint(),
        secret_file.display()
    );
    tokio::signal::ctrl_c().await?;
    for path in [
        "/v1/auth/upstream/inventory",
        "/v1/auth/rules/finance",
        "/v1/auth/config",
    ] {
        let _ = http
            .delete(format!("{}{path}", args.admin))
            .bearer_auth(token)
            .send()
            .await;
    }
    println!("auth is off again");
    Ok(())
}

/// Writes the client secret readable by its owner alone (it lets anyone who has it mint
/// tokens for the gateway's upstreams).
fn write_secret(path: &std::path::Path, secret: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    // A file left by an earlier run keeps its mode: set it.
    file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    file.write_all(secret.as_bytes())
}
