//! `toolgate-register`: registers one MCP server instance in etcd for as long as it lives.
//!
//! With a command after `--` it runs the server as its child: registers once the child answers
//! its probe (the health endpoint or the MCP endpoint, see `--probe`), revokes before passing
//! SIGTERM on, and exits with the child's code. A child that exits on its own is deregistered
//! at once and, as `--restart` says, started again and registered once it passes its probe.
//! Without `--tools` it registers the tools the server lists and keeps that list current.
//!
//! With `--stdio` the command is a stdio MCP server: the registrar bridges it (see
//! `toolgate_registrar::stdio`), serving Streamable HTTP on `--listen` and registering that.

use std::process::{ExitCode, ExitStatus};
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use tokio::process::{Child, Command};
use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::sync::{oneshot, watch};
use toolgate_model::ProbeKind;
use toolgate_probe::mcp::tools::{ListLimits, Listing};
use toolgate_probe::mcp::McpClient;
use toolgate_registrar::liveness;
use toolgate_registrar::probe_kind::{self, Requested, Target};
use toolgate_registrar::ready::{self, Readiness};
use toolgate_registrar::restart::{self, Decision, Restarts};
use toolgate_registrar::tools::{self, Follower};
use toolgate_registrar::{Endpoint, RegisterError, Registrar, Registration};
use tracing::{error, info, warn};

/// Exit code for bad input, as clap uses for bad flags.
const USAGE: u8 = 2;

#[derive(Parser, Debug)]
#[command(
    name = "toolgate-register",
    version,
    about = "Register an MCP server instance in etcd for toolgate; with `-- COMMAND` run it as a child."
)]
struct Args {
    /// etcd endpoints, comma-separated (http://host:port or host:port).
    #[arg(long, env = "TOOLGATE_ETCD", value_delimiter = ',', required = true)]
    etcd: Vec<String>,
    #[command(flatten)]
    access: toolgate_etcd_access::EtcdAccessArgs,
    /// Key prefix in etcd.
    #[arg(long, env = "TOOLGATE_PREFIX", default_value = toolgate_model::DEFAULT_PREFIX)]
    prefix: String,
    /// Service name ([A-Za-z0-9_.-]{1,128}).
    #[arg(long)]
    service: String,
    /// Where the instance listens, host:port (IPv6 as [::1]:8080). With --stdio: where
    /// gateways reach the bridge (default: the --listen address).
    #[arg(long, required_unless_present = "stdio")]
    endpoint: Option<Endpoint>,
    /// Tool names the instance serves, comma-separated. Without it the server's own
    /// `tools/list` (over MCP) decides, and the registered list follows its changes.
    #[arg(long, value_delimiter = ',')]
    tools: Option<Vec<String>>,
    /// How toolgate probes the instance: http (GET <health-path> answers 2xx), mcp (the MCP
    /// endpoint answers), tcp (a connect succeeds), or auto: http if the health endpoint
    /// answers 2xx, else mcp if the MCP endpoint answers (tcp only when asked for).
    #[arg(long, default_value = "auto")]
    probe: Requested,
    /// With tools discovered (no --tools), how often to list them again when the server
    /// announces no changes on a stream; 0 never.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    tools_refresh: Duration,
    /// Instance id; defaults to <hostname>-<port>.
    #[arg(long)]
    instance_id: Option<String>,
    /// Lease TTL in seconds; keepalives go every TTL/3.
    #[arg(long, default_value_t = 10)]
    ttl: i64,
    /// Load-balancing weight, 1..=128.
    #[arg(long, default_value_t = 1)]
    weight: u32,
    /// Path of the instance's MCP endpoint.
    #[arg(long, default_value = "/mcp")]
    mcp_path: String,
    /// Path of the instance's health endpoint.
    #[arg(long, default_value = "/health")]
    health_path: String,
    /// Version of the server, for operators.
    #[arg(long = "server-version", default_value = "")]
    server_version: String,
    /// Zone the instance runs in.
    #[arg(long, default_value = "")]
    zone: String,
    /// Extra labels, key=value; repeatable.
    #[arg(long = "label", value_parser = parse_label)]
    labels: Vec<(String, String)>,
    /// Register only once the instance passes its probe (default: on with a child, off without).
    #[arg(long)]
    wait_healthy: Option<bool>,
    /// How long to wait for the probe to pass (and, without --tools, for tools/list).
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    wait_healthy_timeout: Duration,
    /// How long to keep trying to reach etcd at start before giving up.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    etcd_timeout: Duration,
    /// Serve `GET /ready` on this address: 200 while the instance is registered, 503 before,
    /// while a lost lease is being replaced, and while deregistering (a readiness probe).
    #[arg(long, value_name = "ADDR")]
    ready_listen: Option<std::net::SocketAddr>,
    /// Without a child: how often to connect to the server, once it has accepted a connection,
    /// to find out that it is gone (a refused connection: nothing listens any more). Then the
    /// instance is deregistered at once instead of staying routed until toolgate's probes
    /// notice, and registered again once the server accepts connections and passes its probe.
    /// 0 turns the watch off. Only a refusal counts; a slow or frozen server is left to
    /// toolgate's probes.
    #[arg(long, default_value = "250ms", value_parser = humantime::parse_duration)]
    watch_interval: Duration,
    /// After passing SIGTERM to the child, how long to wait before SIGKILL.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    stop_timeout: Duration,
    /// With a child: when to start it again after it exits on its own. on-failure: after a
    /// non-zero exit or a death by signal (a server that exits 0 stopped on purpose); always:
    /// after any exit; never: deregister and exit with the server's code. At the exit the
    /// instance is deregistered at once; the restarted server is registered again once it
    /// passes its probe, as at the first start. SIGTERM or SIGINT to the registrar stops the
    /// server for good. Under Kubernetes use never, and let the pod's restartPolicy restart the
    /// container.
    #[arg(long, default_value = "on-failure")]
    restart: restart::Policy,
    /// Restarts allowed in a row: one more exit of a server that ran less than
    /// --restart-window, and the registrar gives up and exits non-zero (a crash loop).
    #[arg(long, default_value_t = 5)]
    restart_limit: u32,
    /// A server that ran this long before it exited starts a new row: the count and the delay
    /// start over.
    #[arg(long, default_value = "1m", value_parser = humantime::parse_duration)]
    restart_window: Duration,
    /// The delay before the first restart of a row, doubled for each further one up to
    /// --restart-delay-max (each jittered down by up to half).
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    restart_delay: Duration,
    /// The cap of the delay between restarts.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    restart_delay_max: Duration,
    /// The server to run as a child, after `--`.
    #[arg(last = true)]
    command: Vec<String>,
    // Last: its help heading would also take the fields after it.
    #[command(flatten)]
    stdio: StdioArgs,
}

/// Bridging a stdio MCP server.
#[derive(clap::Args, Debug)]
#[command(next_help_heading = "Bridging a stdio server (--stdio)")]
struct StdioArgs {
    /// The command after `--` is a stdio MCP server (JSON-RPC on its stdin and stdout, one
    /// client per process): serve it as Streamable HTTP on --listen, in every revision the
    /// gateway speaks, and register that endpoint (probed with mcp, tools listed from a
    /// server). By default each MCP session gets a server process of its own; see --shared.
    /// 2026-07-28 requests go to a pool of servers (--pool). A server that exits, hangs, or
    /// writes a line that is not JSON-RPC or longer than --max-message-bytes is ended, the
    /// calls waiting on it get JSON-RPC errors saying so, and it is started again as
    /// --restart says. Its stderr goes to this log with its pid.
    #[arg(long)]
    stdio: bool,
    /// Where the bridge serves MCP (its path is --mcp-path) [default: 127.0.0.1 on a free
    /// port]. For an address gateways cannot reach as it is (0.0.0.0), give --endpoint.
    #[arg(long, value_name = "ADDR", requires = "stdio")]
    listen: Option<std::net::SocketAddr>,
    /// One server process for every session, opened by the bridge: ids are rewritten so that
    /// each answer and progress notification reaches its session, list changes go to every
    /// session, and other messages of the server (requests to the client, log messages) to the
    /// session whose call has waited longest. For servers that keep no per-client state:
    /// far cheaper than a process per session.
    #[arg(long, requires = "stdio")]
    shared: bool,
    /// The most MCP sessions at once (each with its own server process unless --shared);
    /// beyond, `initialize` gets HTTP 503 with a JSON-RPC error saying so.
    #[arg(long, default_value_t = 32)]
    max_sessions: usize,
    /// A session unused this long (no request in progress, no GET stream) ends, and its
    /// server with it; 0 never.
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
    session_idle_timeout: Duration,
    /// Server processes kept warm for 2026-07-28 requests (which stand alone), the tool
    /// listing and the probes; the least busy takes each request.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pool: u16,
    /// Server processes started ahead for new sessions, so that a session does not wait for
    /// one to start (not with --shared).
    #[arg(long, default_value_t = 1)]
    spares: usize,
    /// The longest JSON-RPC message, either way: a longer request is refused (413), a server
    /// that writes a longer line is ended. Bytes, or with KiB/MiB/GiB.
    #[arg(long, default_value = "4MiB", value_parser = parse_bytes)]
    max_message_bytes: usize,
    /// A server with calls waiting that writes nothing this long is sent a ping, and ended as
    /// hung if it does not answer that within as long; 0 never.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    hang_timeout: Duration,
}

fn parse_bytes(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (digits, unit) = match s.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => s.split_at(i),
        None => (s, ""),
    };
    let n: usize = digits
        .parse()
        .map_err(|_| format!("{s:?} is not a number of bytes (4194304, 4MiB)"))?;
    let scale: usize = match unit.trim() {
        "" | "B" => 1,
        "KiB" | "K" | "k" => 1 << 10,
        "MiB" | "M" => 1 << 20,
        "GiB" | "G" => 1 << 30,
        other => return Err(format!("unit {other:?} is not one of KiB, MiB, GiB")),
    };
    n.checked_mul(scale)
        .filter(|n| *n > 0)
        .ok_or_else(|| format!("{s:?} is not a usable number of bytes"))
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .filter(|(k, _)| !k.is_empty())
        .ok_or_else(|| format!("label {s:?} is not key=value"))
}

// One thread: the child is forked from it, and PR_SET_PDEATHSIG fires when the forking thread
// (not the process) exits, so a worker thread that retires would kill the child.
#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    match run(args).await {
        Ok(code) => code,
        Err(Failure::Usage(msg)) => {
            eprintln!("toolgate-register: error: {msg}");
            ExitCode::from(USAGE)
        }
        Err(Failure::Other(e)) => {
            eprintln!("toolgate-register: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

enum Failure {
    Usage(String),
    Other(anyhow::Error),
}

impl From<anyhow::Error> for Failure {
    fn from(e: anyhow::Error) -> Self {
        Failure::Other(e)
    }
}

impl From<RegisterError> for Failure {
    fn from(e: RegisterError) -> Self {
        if e.is_usage() {
            Failure::Usage(e.to_string())
        } else {
            Failure::Other(e.into())
        }
    }
}

async fn run(args: Args) -> Result<ExitCode, Failure> {
    if args.stdio.stdio {
        return run_stdio(args).await;
    }
    let Some(endpoint) = args.endpoint.clone() else {
        return Err(Failure::Usage("--endpoint is required".into()));
    };
    let given = tools_given(&args);
    let registrar = registrar_of(&args, endpoint.clone(), given.as_deref())?;
    let readiness = serve_readiness(&args).await?;

    let mut child = match args.command.split_first() {
        Some((program, rest)) => Some(
            spawn_child(program, rest)
                .map_err(|e| Failure::Usage(format!("cannot run {program:?}: {e}")))?,
        ),
        None => None,
    };
    let mut started = tokio::time::Instant::now();
    let mut restarts = Restarts::new(args.restart, restart_limits(&args));
    let mut sigterm = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
    let mut sigint = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;

    let target = Target::new(
        endpoint.clone(),
        &args.health_path,
        &args.mcp_path,
        PROBE_TIMEOUT,
    );
    let mut mcp = target.mcp_client();
    let mut plan = Plan::of(&args, child.is_some(), given.is_some());
    // Without a child the registrar outlives its server: each pass registers it once, and a
    // pass ends when the server goes away (then the next waits for it) or at a signal.
    loop {
        let prepared = tokio::select! {
            r = prepare(&target, &mut mcp, &plan, given.as_deref(),
                || child.as_mut().is_none_or(|c| matches!(c.try_wait(), Ok(None)))) => r,
            _ = sigterm.recv() => return Ok(stop_child(child, args.stop_timeout).await),
            _ = sigint.recv() => return Ok(stop_child(child, args.stop_timeout).await),
        };
        let prepared = match prepared {
            Ok(p) => p,
            Err(e) => {
                if let Some(mut c) = child {
                    if let Ok(Some(status)) = c.try_wait() {
                        error!(%status, error = %e, "server exited before it answered its probe");
                        let _ = close_session(&mut mcp).await;
                        let ran = started.elapsed();
                        match after_exit(
                            status,
                            ran,
                            &mut restarts,
                            &args.command,
                            &readiness,
                            &mut sigterm,
                            &mut sigint,
                        )
                        .await?
                        {
                            Next::Started(c) => {
                                child = Some(c);
                                started = tokio::time::Instant::now();
                                mcp = target.mcp_client();
                                continue;
                            }
                            Next::Exit(code) => return Ok(code),
                        }
                    }
                    child = Some(c);
                }
                let _ = close_session(&mut mcp).await;
                stop_child(child, args.stop_timeout).await;
                return Err(Failure::Other(anyhow::anyhow!(e)));
            }
        };
        let listed = match prepared.kind {
            ProbeKind::Mcp => mcp.negotiated().map(|n| n.versions()).unwrap_or_default(),
            _ => Vec::new(),
        };
        let (versions, dropped) = probe_kind::registrable_versions(&endpoint, listed);
        if !dropped.is_empty() {
            warn!(
            ?dropped,
            "revisions the server lists that are not registered (not revision names, or past 16)"
        );
        }
        // Each pass registers from the same base: what the server said this time decides.
        let this_pass = registrar.clone().metadata(|m| {
            m.probe = prepared.kind;
            m.protocol_versions = versions;
            if let Some(listing) = &prepared.listing {
                m.tools = listing.names.clone();
            }
        });

        let registration = match this_pass.register().await {
            Ok(r) => r,
            Err(e) => {
                let _ = close_session(&mut mcp).await;
                stop_child(child, args.stop_timeout).await;
                return Err(e.into());
            }
        };
        track_readiness(&registration, readiness.clone());

        // Discovered tools are followed; tools given by hand are the operator's word.
        let follower = match &prepared.listing {
            Some(listing) => {
                let (stop, stop_rx) = oneshot::channel();
                let f = Follower::new(
                    mcp,
                    registration.updater(),
                    listing,
                    args.tools_refresh,
                    ListLimits::default(),
                    PROBE_TIMEOUT,
                );
                Some((stop, tokio::spawn(f.run(stop_rx))))
            }
            None => {
                // Nothing follows the list: the session the checks opened has done its work, and
                // a server should not hold it for the life of the instance.
                let _ = close_session(&mut mcp).await;
                None
            }
        };
        let stopping = Stopping {
            registration,
            readiness: &readiness,
            follower,
        };

        let code = match child.as_mut() {
            Some(c) => {
                let exited = tokio::select! {
                    status = c.wait() => Some(status.context("waiting for the child")?),
                    _ = sigterm.recv() => {
                        info!("SIGTERM: deregistering before stopping the server");
                        None
                    }
                    _ = sigint.recv() => {
                        info!("SIGINT: deregistering before stopping the server");
                        None
                    }
                };
                if let Some(status) = exited {
                    warn!(%status, "server exited; deregistering");
                    stopping.run(false).await;
                    let ran = started.elapsed();
                    match after_exit(
                        status,
                        ran,
                        &mut restarts,
                        &args.command,
                        &readiness,
                        &mut sigterm,
                        &mut sigint,
                    )
                    .await?
                    {
                        Next::Started(c) => {
                            child = Some(c);
                            started = tokio::time::Instant::now();
                            mcp = target.mcp_client();
                            continue;
                        }
                        Next::Exit(code) => return Ok(code),
                    }
                }
                stopping.run(true).await;
                stop_child(child, args.stop_timeout).await
            }
            None => {
                let gone = async {
                    if args.watch_interval.is_zero() {
                        std::future::pending().await
                    } else {
                        // A server never seen accepting (registered before it runs, --tools given)
                        // is not yet watched for going away.
                        liveness::until_accepting(&endpoint, args.watch_interval).await;
                        liveness::until_refused(&endpoint, args.watch_interval).await
                    }
                };
                tokio::select! {
                    _ = sigterm.recv() => info!("SIGTERM: deregistering"),
                    _ = sigint.recv() => info!("SIGINT: deregistering"),
                    why = gone => {
                        warn!(endpoint = %endpoint, %why,
                            "the server refuses connections (it crashed or stopped): deregistering \
                            until it accepts them again");
                        stopping.run(false).await;
                        readiness.send_replace(Readiness::ServerGone { why });
                        tokio::select! {
                            () = liveness::until_accepting(&endpoint, args.watch_interval) => {}
                            _ = sigterm.recv() => return Ok(ExitCode::SUCCESS),
                            _ = sigint.recv() => return Ok(ExitCode::SUCCESS),
                        }
                        info!(endpoint = %endpoint,
                            "the server accepts connections again; registering it once it passes its probe");
                        readiness.send_replace(Readiness::Starting);
                        plan = Plan::rejoin(&args);
                        mcp = target.mcp_client();
                        continue;
                    }
                }
                stopping.run(true).await;
                ExitCode::SUCCESS
            }
        };
        return Ok(code);
    }
}

/// The tools given by hand (`--tools`), empty names left out.
fn tools_given(args: &Args) -> Option<Vec<String>> {
    args.tools
        .as_ref()
        .map(|t| t.iter().filter(|t| !t.is_empty()).cloned().collect())
}

fn restart_limits(args: &Args) -> restart::Limits {
    restart::Limits {
        limit: args.restart_limit,
        window: args.restart_window,
        delay: args.restart_delay,
        max_delay: args.restart_delay_max,
    }
}

/// What to register, from the flags; checked before a process is started or etcd is touched.
fn registrar_of(
    args: &Args,
    endpoint: Endpoint,
    given: Option<&[String]>,
) -> Result<Registrar, Failure> {
    let access = args
        .access
        .load()
        .map_err(|e| Failure::Usage(e.to_string()))?;
    let mut registrar = Registrar::new(&args.etcd, &args.service, endpoint)
        .etcd_access(access)
        .prefix(&args.prefix)
        .tools(given.map(<[String]>::to_vec).unwrap_or_default())
        .ttl_secs(args.ttl)
        .startup_timeout(args.etcd_timeout)
        .metadata(|m| {
            m.weight = args.weight;
            m.mcp_path = args.mcp_path.clone();
            m.health_path = args.health_path.clone();
            m.version = args.server_version.clone();
            m.zone = args.zone.clone();
            m.labels = args.labels.iter().cloned().collect();
        });
    if let Some(id) = &args.instance_id {
        registrar = registrar.instance_id(id);
    }
    registrar.validate()?;
    Ok(registrar)
}

/// Serves `GET /ready` when asked to; bound before anything else can fail late, so a probe
/// finds the port from the start.
async fn serve_readiness(args: &Args) -> Result<watch::Sender<Readiness>, Failure> {
    let (readiness, readiness_rx) = watch::channel(Readiness::Starting);
    if let Some(addr) = args.ready_listen {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| Failure::Usage(format!("cannot listen on --ready-listen {addr}: {e}")))?;
        let mut closed = readiness_rx.clone();
        tokio::spawn(async move {
            let shutdown = async move { while closed.changed().await.is_ok() {} };
            if let Err(e) = ready::serve(listener, readiness_rx, shutdown).await {
                warn!(error = %e, "the readiness endpoint stopped");
            }
        });
        info!(%addr, "serving GET /ready");
    }
    Ok(readiness)
}

/// `--stdio`: the bridge serves the stdio server on --listen; the registrar registers the
/// bridge's endpoint, as it would a server's, until a signal (or the bridge giving up, as
/// --restart says).
async fn run_stdio(args: Args) -> Result<ExitCode, Failure> {
    if args.command.is_empty() {
        return Err(Failure::Usage(
            "--stdio needs the stdio server's command after `--`".into(),
        ));
    }
    if matches!(args.probe, Requested::Kind(k) if k != ProbeKind::Mcp) {
        return Err(Failure::Usage(
            "--stdio serves MCP and nothing else: its probe is mcp (leave --probe out)".into(),
        ));
    }
    if !args.mcp_path.starts_with('/') {
        return Err(Failure::Usage(format!(
            "--mcp-path {:?} must start with /",
            args.mcp_path
        )));
    }
    let listen = args
        .stdio
        .listen
        .unwrap_or_else(|| std::net::SocketAddr::from(([127, 0, 0, 1], 0)));
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| Failure::Usage(format!("cannot listen on --listen {listen}: {e}")))?;
    let bound = listener
        .local_addr()
        .map_err(|e| Failure::Other(anyhow::anyhow!("the bridge's address: {e}")))?;
    let endpoint = match (&args.endpoint, bound.ip().is_unspecified()) {
        (Some(e), _) => e.clone(),
        (None, false) => bound
            .to_string()
            .parse::<Endpoint>()
            .map_err(|e| Failure::Usage(e.to_string()))?,
        (None, true) => {
            return Err(Failure::Usage(format!(
                "--listen {bound} is every address: give --endpoint, the address gateways reach                  this bridge at"
            )))
        }
    };
    let given = tools_given(&args);
    let registrar = registrar_of(&args, endpoint.clone(), given.as_deref())?;
    let readiness = serve_readiness(&args).await?;
    let mut sigterm = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
    let mut sigint = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;

    let options = toolgate_registrar::stdio::Options {
        command: args.command.clone(),
        mcp_path: args.mcp_path.clone(),
        shared: args.stdio.shared,
        max_sessions: args.stdio.max_sessions,
        session_idle_timeout: args.stdio.session_idle_timeout,
        pool: usize::from(args.stdio.pool),
        spares: args.stdio.spares,
        max_message_bytes: args.stdio.max_message_bytes,
        hang_timeout: args.stdio.hang_timeout,
        startup_timeout: args.wait_healthy_timeout,
        stop_timeout: args.stop_timeout,
        restart: args.restart,
        restart_limits: restart_limits(&args),
    };
    let mode = if options.shared {
        "one server for every session (--shared)"
    } else {
        "a server per session"
    };
    info!(listen = %bound, %endpoint, command = ?args.command, mode, pool = options.pool,
        "bridging a stdio MCP server");
    let bridge = toolgate_registrar::stdio::Bridge::start(listener, options);

    let target = Target::new(
        endpoint.clone(),
        &args.health_path,
        &args.mcp_path,
        PROBE_TIMEOUT,
    );
    let mut mcp = target.mcp_client();
    let plan = Plan {
        requested: Requested::Kind(ProbeKind::Mcp),
        wait: true,
        patience: args.wait_healthy_timeout,
        must_detect: true,
    };
    let prepared = tokio::select! {
        r = prepare(&target, &mut mcp, &plan, given.as_deref(), || true) => r,
        fatal = bridge.failed() => Err(fatal.why),
        _ = sigterm.recv() => { bridge.shutdown().await; return Ok(ExitCode::SUCCESS) }
        _ = sigint.recv() => { bridge.shutdown().await; return Ok(ExitCode::SUCCESS) }
    };
    let prepared = match prepared {
        Ok(p) => p,
        Err(e) => {
            bridge.shutdown().await;
            return Err(Failure::Other(anyhow::anyhow!(e)));
        }
    };
    let listed = mcp.negotiated().map(|n| n.versions()).unwrap_or_default();
    let (versions, _) = probe_kind::registrable_versions(&endpoint, listed);
    let this_pass = registrar.metadata(|m| {
        m.probe = ProbeKind::Mcp;
        m.protocol_versions = versions;
        if let Some(listing) = &prepared.listing {
            m.tools = listing.names.clone();
        }
    });
    let registration = match this_pass.register().await {
        Ok(r) => r,
        Err(e) => {
            bridge.shutdown().await;
            return Err(e.into());
        }
    };
    track_readiness(&registration, readiness.clone());
    let follower = match &prepared.listing {
        Some(listing) => {
            let (stop, stop_rx) = oneshot::channel();
            let f = Follower::new(
                mcp,
                registration.updater(),
                listing,
                args.tools_refresh,
                ListLimits::default(),
                PROBE_TIMEOUT,
            );
            Some((stop, tokio::spawn(f.run(stop_rx))))
        }
        None => None,
    };
    let stopping = Stopping {
        registration,
        readiness: &readiness,
        follower,
    };
    let fatal = tokio::select! {
        _ = sigterm.recv() => { info!("SIGTERM: deregistering, then stopping the bridge"); None }
        _ = sigint.recv() => { info!("SIGINT: deregistering, then stopping the bridge"); None }
        fatal = bridge.failed() => Some(fatal),
    };
    stopping.run(true).await;
    bridge.shutdown().await;
    Ok(match fatal {
        None => ExitCode::SUCCESS,
        Some(f) => {
            error!("deregistered: {}", f.why);
            match f.status {
                Some(status) if !status.success() => exit_code(status),
                _ => ExitCode::FAILURE,
            }
        }
    })
}

/// How long one probe or MCP request of the instance may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// Without a child or --wait-healthy the server is up already or starting beside us: tried
/// this long before giving up, so a registrar started together with its server need not race.
const UNWRAPPED_PATIENCE: Duration = Duration::from_secs(3);

/// What must be known about the server before registering, and for how long to try.
struct Plan {
    requested: Requested,
    /// The probe must pass before registering (--wait-healthy).
    wait: bool,
    /// How long probing (and listing) may be retried.
    patience: Duration,
    /// A failed `auto` is fatal (otherwise: register with the http kind, as before probe
    /// kinds existed).
    must_detect: bool,
}

impl Plan {
    /// Registering again a server that came back: it must pass its probe first (it may still
    /// be starting), and it gets the startup window to do so.
    fn rejoin(args: &Args) -> Plan {
        Plan {
            requested: args.probe,
            wait: true,
            patience: args.wait_healthy_timeout,
            must_detect: true,
        }
    }

    fn of(args: &Args, has_child: bool, tools_given: bool) -> Plan {
        let wait = args.wait_healthy.unwrap_or(has_child);
        // The tools must come from the server when not given: then it must answer, and a
        // child gets the whole startup window to do so.
        let needs_server = wait || !tools_given;
        let patience = if wait || (has_child && !tools_given) {
            args.wait_healthy_timeout
        } else if !tools_given {
            UNWRAPPED_PATIENCE
        } else {
            Duration::ZERO
        };
        Plan {
            requested: args.probe,
            wait,
            patience,
            must_detect: needs_server,
        }
    }
}

/// The probe kind, how it was chosen, and the server's listing when it decides the tools.
struct Prepared {
    kind: ProbeKind,
    listing: Option<Listing>,
}

/// Picks the probe kind (waiting for it to pass when asked to), then lists the tools: the
/// list to register when none were given, a check of the given ones otherwise.
async fn prepare(
    target: &Target,
    mcp: &mut McpClient,
    plan: &Plan,
    given: Option<&[String]>,
    mut still_wanted: impl FnMut() -> bool,
) -> Result<Prepared, String> {
    let started = tokio::time::Instant::now();
    let deadline = started + plan.patience;
    let kind = match (plan.requested, plan.wait) {
        // Asked for a kind, not asked to wait: nothing to find out.
        (Requested::Kind(kind), false) => {
            info!(probe = %kind, "probe kind asked for");
            kind
        }
        (requested, _) => {
            match probe_kind::settle(target, requested, mcp, deadline, &mut still_wanted).await {
                Ok(chosen) => {
                    info!(probe = %chosen.kind, why = %chosen.why,
                        after_ms = started.elapsed().as_millis() as u64,
                        "server is healthy; probe kind chosen");
                    chosen.kind
                }
                Err(e) if plan.must_detect => return Err(e),
                Err(e) => {
                    warn!(error = %e, "no probe kind found; registering with the http probe, as \
                        before probe kinds existed (the server need not run yet: --tools given, \
                        --wait-healthy off)");
                    ProbeKind::Http
                }
            }
        }
    };
    match given {
        Some(given) => {
            // Checked once: a server that does not speak MCP (yet) is not an error here.
            match mcp.list_tools(ListLimits::default()).await {
                Ok(listing) => {
                    let notes = tools::compare_given(given, &listing.names);
                    for n in &notes {
                        warn!("{n}");
                    }
                    if notes.is_empty() {
                        info!(tools = ?given, "the server lists the tools given by --tools");
                    }
                }
                Err(e) => {
                    info!(error = %e, "the tools given by --tools are not checked: the server's tools/list did not answer")
                }
            }
            Ok(Prepared {
                kind,
                listing: None,
            })
        }
        None => {
            let listing = loop {
                match mcp.list_tools(ListLimits::default()).await {
                    Ok(l) => break l,
                    Err(e) => {
                        let why = format!(
                            "no --tools given, and the server's tools/list at {} failed: {e}",
                            target.mcp_url()
                        );
                        if tokio::time::Instant::now() >= deadline {
                            return Err(why);
                        }
                        if !still_wanted() {
                            return Err(format!("the server exited: {why}"));
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            for n in tools::listing_notes(&listing) {
                warn!("{n}");
            }
            info!(tools = ?listing.names, pages = listing.pages, "tools listed by the server");
            Ok(Prepared {
                kind,
                listing: Some(listing),
            })
        }
    }
}

/// What is undone on the way out, in order: the tool follower (so it cannot put after the
/// revoke), the registration, then the registrar's MCP session while the server still runs.
struct Stopping<'a> {
    registration: Registration,
    readiness: &'a watch::Sender<Readiness>,
    follower: Option<(oneshot::Sender<()>, tokio::task::JoinHandle<McpClient>)>,
}

impl Stopping<'_> {
    async fn run(self, server_alive: bool) {
        let mut mcp = None;
        if let Some((stop, task)) = self.follower {
            let _ = stop.send(());
            let abort = task.abort_handle();
            match tokio::time::timeout(PROBE_TIMEOUT, task).await {
                Ok(Ok(client)) => mcp = Some(client),
                _ => {
                    // Stopped hard: it must not put the key after the revoke (a put on the
                    // revoked lease would fail anyway, but quietly is better).
                    abort.abort();
                    warn!("the tool list follower did not stop in time; its MCP session is left to expire")
                }
            }
        }
        deregister(self.registration, self.readiness).await;
        if let (Some(mut client), true) = (mcp, server_alive) {
            if let Err(e) = close_session(&mut client).await {
                info!(error = %e, "closing the MCP session failed; the server expires it");
            }
        }
    }
}

async fn close_session(mcp: &mut McpClient) -> Result<(), String> {
    let had = mcp.open_session().is_some();
    mcp.close().await?;
    if had {
        info!("MCP session closed");
    }
    Ok(())
}

/// Follows the registration's events into what `/ready` says, until it is deregistered.
fn track_readiness(registration: &Registration, readiness: watch::Sender<Readiness>) {
    let key = registration.key().to_string();
    let mut events = registration.events();
    tokio::spawn(async move {
        loop {
            let now = Readiness::from_event(&key, *events.borrow_and_update());
            // Once stopping, a late event must not make the instance look ready again.
            readiness.send_if_modified(|r| {
                let change = *r != Readiness::Stopping && *r != now;
                if change {
                    *r = now.clone();
                }
                change
            });
            if events.changed().await.is_err() {
                break;
            }
        }
    });
}

async fn deregister(registration: Registration, readiness: &watch::Sender<Readiness>) {
    readiness.send_replace(Readiness::Stopping);
    if let Err(e) = registration.deregister().await {
        warn!(error = %e, "deregistering failed");
    }
}

/// What follows a child's exit on its own (its instance deregistered already).
enum Next {
    /// The server was started again: register it once it passes its probe.
    Started(Child),
    /// The registrar ends with this code.
    Exit(ExitCode),
}

/// Starts the server again after its exit when `--restart` says so (after the backoff's delay,
/// unless a signal ends the registrar meanwhile), or says what the registrar exits with.
async fn after_exit(
    status: ExitStatus,
    ran: Duration,
    restarts: &mut Restarts,
    command: &[String],
    readiness: &watch::Sender<Readiness>,
    sigterm: &mut Signal,
    sigint: &mut Signal,
) -> Result<Next, Failure> {
    let policy = restarts.policy();
    match restarts.after_exit(!status.success(), ran, rand::random()) {
        Decision::Exit => {
            if policy != restart::Policy::Never && !status.success() {
                info!(%status, "not restarting the server (--restart {policy})");
            }
            Ok(Next::Exit(exit_code(status)))
        }
        Decision::GiveUp { exits } => {
            let limits = restarts.limits();
            error!(%status,
                "giving up: the server exited {exits} times in a row, each less than {} after it \
                 started (--restart-window), and --restart-limit allows {} restarts; not starting \
                 it again",
                humantime::format_duration(limits.window), limits.limit);
            readiness.send_replace(Readiness::Stopping);
            Ok(Next::Exit(if status.success() {
                ExitCode::FAILURE
            } else {
                exit_code(status)
            }))
        }
        Decision::Restart { delay, nth } => {
            warn!(%status, restart = nth, limit = restarts.limits().limit,
                delay_ms = delay.as_millis() as u64,
                "restarting the server (--restart {policy}); it is registered again once it \
                 passes its probe");
            readiness.send_replace(Readiness::Restarting {
                exited: status.to_string(),
                nth,
            });
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                _ = sigterm.recv() => {
                    info!("SIGTERM while the server waited to restart: exiting");
                    return Ok(Next::Exit(ExitCode::SUCCESS));
                }
                _ = sigint.recv() => {
                    info!("SIGINT while the server waited to restart: exiting");
                    return Ok(Next::Exit(ExitCode::SUCCESS));
                }
            }
            let (program, rest) = command
                .split_first()
                .ok_or_else(|| anyhow::anyhow!("no server command to restart"))?;
            let child = spawn_child(program, rest)
                .with_context(|| format!("restarting the server: cannot run {program:?}"))?;
            info!(restart = nth, "server started again");
            Ok(Next::Started(child))
        }
    }
}

fn spawn_child(program: &str, args: &[String]) -> std::io::Result<Child> {
    let mut cmd = Command::new(program);
    cmd.args(args)
        // Its own process group: a terminal's Ctrl-C reaches only us, so we can revoke first.
        .process_group(0)
        .kill_on_drop(true);
    // SAFETY: prctl is async-signal-safe; the closure allocates nothing.
    unsafe {
        cmd.pre_exec(|| {
            // If we are SIGKILLed, the child must not live on unregistered and unsupervised.
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM)
                .map_err(std::io::Error::from)
        });
    }
    cmd.spawn()
}

/// Passes SIGTERM to the child, waits up to `timeout`, then SIGKILLs it; returns its exit code.
async fn stop_child(child: Option<Child>, timeout: Duration) -> ExitCode {
    let Some(mut child) = child else {
        return ExitCode::SUCCESS;
    };
    if let Ok(Some(status)) = child.try_wait() {
        return exit_code(status);
    }
    if let Some(pid) = child.id() {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
    }
    match tokio::time::timeout(timeout, child.wait()).await {
        Ok(Ok(status)) => exit_code(status),
        Ok(Err(e)) => {
            error!(error = %e, "waiting for the child failed");
            ExitCode::FAILURE
        }
        Err(_) => {
            warn!(
                timeout_ms = timeout.as_millis() as u64,
                "server did not stop in time; killing it"
            );
            let _ = child.kill().await;
            ExitCode::from(128 + 9)
        }
    }
}

fn exit_code(status: std::process::ExitStatus) -> ExitCode {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => ExitCode::from(code.clamp(0, 255) as u8),
        (None, Some(sig)) => ExitCode::from((128 + sig).clamp(0, 255) as u8),
        _ => ExitCode::FAILURE,
    }
}
