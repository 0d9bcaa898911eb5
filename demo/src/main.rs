//! `toolgate-demo`: one sample MCP service (inventory, finance or code) over
//! Streamable HTTP at `/mcp`, with `/health`.

use std::{net::SocketAddr, sync::Arc};

use clap::Parser;
use toolgate_demo::{http, logging, mcp::TransportArgs, services, services::Service, shutdown};

/// Sample MCP service for toolgate demos: serves MCP at /mcp and GET /health,
/// prints `listening on ADDR` once bound, stops cleanly on SIGTERM/SIGINT.
#[derive(Debug, Parser)]
#[command(name = "toolgate-demo", version)]
struct Cli {
    /// Which sample service to run.
    #[arg(long, value_enum)]
    service: Service,
    /// Address to listen on; port 0 lets the OS pick (the bound address is printed).
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Put in every tool result so callers can tell instances apart
    /// [default: SERVICE-PID].
    #[arg(long)]
    instance_id: Option<String>,
    #[command(flatten)]
    transport: TransportArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    logging::init();
    let shutdown = shutdown::on_signal()?;
    let instance_id = cli
        .instance_id
        .unwrap_or_else(|| format!("{}-{}", cli.service, std::process::id()));
    tracing::info!(service = %cli.service, instance = %instance_id, "starting");
    let mcp = services::router(
        cli.service,
        Arc::from(instance_id),
        cli.transport.options(),
        &shutdown,
    );
    http::serve(cli.listen, http::router(mcp, Arc::new(|| true)), shutdown).await
}
