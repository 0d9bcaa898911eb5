//! `toolgate-xds`: the control plane (`serve`) and the Envoy bootstrap printer (`bootstrap`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use tokio::signal::unix::{signal, SignalKind};
use toolgate_model::KeyLayout;
use toolgate_xds::admin::{self, AdminState};
use toolgate_xds::bootstrap::{self, BootstrapOptions};
use toolgate_xds::etcd::watch::Watcher;
use toolgate_xds::etcd::{EtcdConfig, EtcdStatus};
use toolgate_xds::metrics::Metrics;
use toolgate_xds::registry::persist;
use toolgate_xds::registry::publish::Publisher;
use toolgate_xds::registry::Registry;
use toolgate_xds::xds;
use tracing::{info, warn};

#[derive(Parser, Debug)]
#[command(
    name = "toolgate-xds",
    version,
    about = "toolgate's control plane: etcd registrations in, Envoy configuration out."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Watch etcd and serve Envoys over ADS, with an admin API.
    Serve(ServeArgs),
    /// Print a ready Envoy bootstrap (JSON) that points at a toolgate-xds.
    Bootstrap(BootstrapArgs),
}

#[derive(Args, Debug)]
struct ServeArgs {
    /// etcd endpoints, comma-separated.
    #[arg(long, env = "TOOLGATE_ETCD", value_delimiter = ',', required = true)]
    etcd: Vec<String>,
    /// Key prefix in etcd.
    #[arg(long, env = "TOOLGATE_PREFIX", default_value = toolgate_model::DEFAULT_PREFIX)]
    prefix: String,
    /// Where Envoys connect for ADS (gRPC).
    #[arg(long, default_value = "127.0.0.1:18000")]
    xds_listen: SocketAddr,
    /// Admin API: /healthz, /metrics, /v1/registry.
    #[arg(long, default_value = "127.0.0.1:19000")]
    admin_listen: SocketAddr,
    /// Directory for the last good registry, served at start when etcd is unreachable.
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// How long one etcd request may take.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    etcd_timeout: Duration,
    /// At start, how long to keep trying etcd before serving the state-dir snapshot.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    startup_wait: Duration,
}

#[derive(Args, Debug)]
struct BootstrapArgs {
    /// Envoy node id (unique per Envoy).
    #[arg(long)]
    node_id: String,
    /// Envoy node cluster.
    #[arg(long, default_value = "toolgate")]
    cluster: String,
    /// Where Envoy listens for MCP clients.
    #[arg(long, default_value = "127.0.0.1:10000")]
    listen: SocketAddr,
    /// Address of toolgate-xds's ADS listener.
    #[arg(long, default_value = "127.0.0.1:18000")]
    xds: SocketAddr,
    /// Envoy's admin listener (keep it on loopback).
    #[arg(long, default_value = "127.0.0.1:9901")]
    admin: SocketAddr,
    /// Path of the toolgate wasm filter.
    #[arg(long)]
    filter: Option<PathBuf>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Bootstrap(args) => {
            let opts = BootstrapOptions {
                node_id: args.node_id,
                cluster: args.cluster,
                listen: args.listen,
                xds: args.xds,
                admin: args.admin,
                filter: args.filter,
            };
            println!("{}", bootstrap::render(&opts));
            ExitCode::SUCCESS
        }
        Command::Serve(args) => {
            tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_default_env()
                        .unwrap_or_else(|_| "info".into()),
                )
                .with_writer(std::io::stderr)
                .init();
            let rt = match tokio::runtime::Runtime::new() {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("toolgate-xds: cannot start the runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            match rt.block_on(serve(args)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("toolgate-xds: error: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let metrics = Arc::new(Metrics::new());
    let registry = Arc::new(RwLock::new(Registry::new(KeyLayout::new(&args.prefix))));
    let status = Arc::new(EtcdStatus::default());
    let (publisher, snapshots) = Publisher::new(metrics.clone(), args.state_dir.clone());

    let xds_listener = tokio::net::TcpListener::bind(args.xds_listen)
        .await
        .with_context(|| format!("binding the xDS listener on {}", args.xds_listen))?;
    let admin_listener = tokio::net::TcpListener::bind(args.admin_listen)
        .await
        .with_context(|| format!("binding the admin listener on {}", args.admin_listen))?;

    let persisted = match &args.state_dir {
        Some(dir) => match persist::load(dir) {
            Ok(state) => Some(state),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => {
                warn!(error = %e, "ignoring an unreadable state-dir snapshot");
                None
            }
        },
        None => None,
    };
    let watcher = Watcher {
        config: EtcdConfig {
            endpoints: args.etcd.clone(),
            request_timeout: args.etcd_timeout,
        },
        registry: registry.clone(),
        publisher,
        metrics: metrics.clone(),
        status: status.clone(),
    };
    tokio::spawn(watcher.run(persisted, args.startup_wait));

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    info!(xds = %args.xds_listen, admin = %args.admin_listen, etcd = ?args.etcd, prefix = %args.prefix,
        "toolgate-xds serving");
    let xds_task = tokio::spawn(xds::serve(
        xds_listener,
        snapshots,
        metrics.clone(),
        stopped(stop_rx.clone()),
    ));
    let admin_task = tokio::spawn(admin::serve(
        admin_listener,
        AdminState {
            metrics,
            registry,
            etcd: status,
        },
        stopped(stop_rx),
    ));

    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    tokio::select! {
        _ = sigterm.recv() => info!("SIGTERM: stopping"),
        _ = sigint.recv() => info!("SIGINT: stopping"),
    }
    let _ = stop_tx.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        let _ = xds_task.await;
        let _ = admin_task.await;
    })
    .await;
    Ok(())
}
