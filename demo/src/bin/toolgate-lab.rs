//! `toolgate-lab`: a configurable MCP server for tests. Its latency, failure
//! modes and health can be set at start and changed at run time via /control.

use std::{net::SocketAddr, sync::Arc};

use clap::{error::ErrorKind, CommandFactory, Parser};
use toolgate_demo::{
    http,
    lab::{
        self,
        knobs::{self, FailureMode, Knobs},
        state::LabState,
    },
    logging,
    mcp::TransportArgs,
    shutdown,
};

/// Configurable MCP server for tests: MCP at /mcp, GET /health (unless
/// --no-health), and a control API (GET/POST /control, POST
/// /control/reset-counters) that changes every knob below at run time. Prints
/// `listening on ADDR` once bound.
#[derive(Debug, Parser)]
#[command(name = "toolgate-lab", version)]
struct Cli {
    /// Address to listen on; port 0 lets the OS pick (the bound address is printed).
    #[arg(long, default_value = "127.0.0.1:8090")]
    listen: SocketAddr,
    /// Put in every tool result and in GET /control [default: lab-PID].
    #[arg(long)]
    instance_id: Option<String>,
    /// Tools to serve; each takes any JSON object and echoes it.
    #[arg(long, value_delimiter = ',', default_value = knobs::DEFAULT_TOOLS, value_parser = knobs::parse_tool_name)]
    tools: Vec<String>,
    /// Delay before answering every tools/call, in milliseconds.
    #[arg(long, default_value_t = 0)]
    latency_ms: u64,
    /// Per-tool delay replacing --latency-ms for that tool (repeatable).
    #[arg(long = "tool-latency", value_name = "TOOL=MS", value_parser = knobs::parse_tool_latency)]
    tool_latency: Vec<(String, u64)>,
    /// Failure mode of a tool (repeatable): none, http500, http500_empty, http502_html,
    /// http503_jsonrpc, sse_ends_early, sse_reset, json_reset, reset, hang, jsonrpc_error or
    /// is_error.
    #[arg(long = "fail", value_name = "TOOL=MODE", value_parser = knobs::parse_fail_spec)]
    fail: Vec<(String, FailureMode)>,
    /// Probability (0.0 to 1.0) that a call to a tool with a failure mode fails.
    #[arg(long, default_value = "1.0", value_parser = knobs::parse_fail_rate)]
    fail_rate: f64,
    /// Serve this many resources (`lab://doc/0` …, about 1 KB of text each) and a prompt
    /// (`brief`), with the capabilities that say so; 0 serves tools only.
    #[arg(long, default_value_t = 0)]
    documents: usize,
    /// Make /health answer 503.
    #[arg(long)]
    health_fail: bool,
    /// Serve no /health route at all (404), like most MCP servers: only an
    /// MCP-level probe can tell whether this lab is up.
    #[arg(long, conflicts_with = "health_fail")]
    no_health: bool,
    #[command(flatten)]
    transport: TransportArgs,
}

impl Cli {
    /// `--tools` in order, each once: a repeated name would list the tool twice.
    fn tools(&self) -> Vec<String> {
        let mut tools: Vec<String> = Vec::with_capacity(self.tools.len());
        for tool in &self.tools {
            if !tools.contains(tool) {
                tools.push(tool.clone());
            }
        }
        tools
    }

    /// The starting knobs. Checks what the flag parsers alone cannot (that
    /// --fail and --tool-latency name served tools), exiting with clap's
    /// usage error, code 2, like any other bad flag.
    fn knobs(&self) -> Knobs {
        let mut knobs = Knobs::new(&self.tools());
        let mut checks = Vec::new();
        checks.push(("--latency-ms", knobs.set_latency(self.latency_ms)));
        for (tool, ms) in &self.tool_latency {
            checks.push(("--tool-latency", knobs.set_tool_latency(tool, Some(*ms))));
        }
        for (tool, mode) in &self.fail {
            checks.push(("--fail", knobs.set_fail(tool, *mode)));
        }
        checks.push(("--fail-rate", knobs.set_fail_rate(self.fail_rate)));
        knobs.health_fail = self.health_fail;
        for (flag, check) in checks {
            if let Err(error) = check {
                Cli::command()
                    .error(ErrorKind::ValueValidation, format!("{flag}: {error}"))
                    .exit();
            }
        }
        knobs
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let knobs = cli.knobs();
    logging::init();
    let shutdown = shutdown::on_signal()?;
    let instance_id = cli
        .instance_id
        .clone()
        .unwrap_or_else(|| format!("lab-{}", std::process::id()));
    let tools = cli.tools();
    tracing::info!(instance = %instance_id, ?tools, ?knobs, "starting");
    let mut state = LabState::new(
        instance_id,
        tools,
        knobs,
        cli.transport.options(),
        shutdown.clone(),
    );
    state.documents = cli.documents;
    let lab = Arc::new(state);
    http::serve(cli.listen, lab::app(lab, !cli.no_health), shutdown).await
}
