//! rmcp's own MCP client over Streamable HTTP: the "real MCP client" of the end-to-end tests.

use std::time::Duration;

use rmcp::model::{CallToolRequestParams, ClientConfig};
use rmcp::service::{RoleClient, RunningService};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::ServiceExt;
use serde_json::Value;

pub type Client = RunningService<RoleClient, ClientConfig>;

const EXCHANGE: Duration = Duration::from_secs(15);

/// Connects and completes `initialize`.
// rmcp's initialize error is large; it only ever reaches a panic message here.
#[allow(clippy::result_large_err)]
pub async fn connect(url: &str) -> Client {
    let transport = StreamableHttpClientTransport::from_uri(url.to_string());
    tokio::time::timeout(EXCHANGE, ClientConfig::default().serve(transport))
        .await
        .unwrap_or_else(|_| panic!("initialize at {url} timed out"))
        .unwrap_or_else(|e| panic!("initialize at {url} failed: {e}"))
}

pub async fn list_tools(client: &Client) -> Vec<String> {
    tokio::time::timeout(EXCHANGE, client.list_all_tools())
        .await
        .expect("tools/list timed out")
        .expect("tools/list failed")
        .into_iter()
        .map(|t| t.name.to_string())
        .collect()
}

/// Calls a tool and returns the text of its result (panics on a protocol error).
pub async fn call_text(client: &Client, tool: &str, arguments: Value) -> String {
    let args = match arguments {
        Value::Object(map) => map,
        other => panic!("arguments must be an object, got {other}"),
    };
    let params = CallToolRequestParams::new(tool.to_string()).with_arguments(args);
    let result = tokio::time::timeout(EXCHANGE, client.call_tool(params))
        .await
        .unwrap_or_else(|_| panic!("tools/call {tool} timed out"))
        .unwrap_or_else(|e| panic!("tools/call {tool} failed: {e}"));
    result
        .content
        .iter()
        .filter_map(|c| c.as_text().map(|t| t.text.clone()))
        .collect::<Vec<_>>()
        .join("\n")
}
