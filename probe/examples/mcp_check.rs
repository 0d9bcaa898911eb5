//! `cargo run --release -p toolgate-probe --example mcp_check -- http://127.0.0.1:PORT/mcp`:
//! negotiates, probes three times, lists the tools and closes the session, printing each step;
//! for trying the client against a server by hand.

use std::time::Duration;

use toolgate_probe::mcp::{tools::ListLimits, McpClient};

#[tokio::main]
async fn main() {
    let Some(url) = std::env::args().nth(1) else {
        eprintln!("usage: mcp_check URL");
        std::process::exit(2);
    };
    let http = toolgate_probe::http::client(Duration::from_secs(2));
    let mut c = McpClient::new(http, url, Duration::from_secs(2), "toolgate-mcp-check");
    for _ in 0..3 {
        println!("probe: {:?}", c.probe().await);
    }
    println!("negotiated: {:?}", c.negotiated());
    match c.list_tools(ListLimits::default()).await {
        Ok(l) => println!(
            "tools: {:?}\nrefused: {:?}\ncut: {:?}",
            l.names, l.refused, l.cut
        ),
        Err(e) => println!("tools/list failed: {e}"),
    }
    println!("close: {:?}", c.close().await);
}
