//! The lab's MCP server: every configured tool takes any JSON object and
//! echoes its name, the instance and the arguments, unless a JSON-RPC-level
//! failure mode says otherwise.

use std::sync::Arc;

use rmcp::{
    model::{
        CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
        JsonObject, ListToolsResult, PaginatedRequestParams, ServerCapabilities, ServerConfig,
        Tool,
    },
    service::RequestContext,
    ErrorData, RoleServer, ServerHandler,
};
use serde_json::{json, Value};

use super::{
    knobs::{FailureMode, Layer},
    state::LabState,
};

#[derive(Clone)]
pub struct EchoTools {
    lab: Arc<LabState>,
}

impl EchoTools {
    pub fn new(lab: Arc<LabState>) -> Self {
        Self { lab }
    }

    fn tool(name: &str) -> Tool {
        let mut schema = JsonObject::new();
        schema.insert("type".to_owned(), json!("object"));
        schema.insert("additionalProperties".to_owned(), json!(true));
        Tool::new(
            name.to_owned(),
            "Lab tool: echoes its name, the answering instance and its arguments.",
            Arc::new(schema),
        )
    }
}

impl ServerHandler for EchoTools {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new(
                "toolgate-lab",
                env!("CARGO_PKG_VERSION"),
            ))
            .with_instructions(format!(
                "Test server (instance {}); tools echo their arguments.",
                self.lab.instance_id
            ))
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        self.lab.serves(name).then(|| Self::tool(name))
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let tools = self.lab.tools.iter().map(|name| Self::tool(name)).collect();
        Ok(ListToolsResult::with_all_items(tools))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let name = request.name.as_ref();
        let instance_id = &self.lab.instance_id;
        if !self.lab.serves(name) {
            return Err(ErrorData::invalid_params(
                format!("unknown tool '{name}'"),
                None,
            ));
        }
        match self.lab.draw_failure(name, Layer::JsonRpc) {
            Some(FailureMode::JsonrpcError) => {
                tracing::info!(tool = name, "injecting failure: jsonrpc_error");
                return Err(ErrorData::internal_error(
                    format!(
                        "injected failure: jsonrpc_error for tool {name} on instance {instance_id}"
                    ),
                    None,
                ));
            }
            Some(FailureMode::IsError) => {
                tracing::info!(tool = name, "injecting failure: is_error");
                let text =
                    format!("injected failure: is_error for tool {name} on instance {instance_id}");
                return Ok(CallToolResult::error(vec![ContentBlock::text(text)]).into());
            }
            _ => {}
        }
        let arguments = Value::Object(request.arguments.unwrap_or_default());
        let echo = json!({
            "tool": name,
            "instance_id": instance_id,
            "arguments": arguments,
        });
        Ok(CallToolResult::structured(echo).into())
    }
}
