//! The lab's MCP server: every configured tool takes any JSON object and
//! echoes its name, the instance and the arguments, unless a JSON-RPC-level
//! failure mode says otherwise. With `--documents N`, also N text resources
//! and one prompt (tools only otherwise, refusing the other methods).

use std::sync::Arc;

use rmcp::{
    model::{
        CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock,
        GetPromptRequestMethod, GetPromptRequestParams, GetPromptResponse, GetPromptResult,
        Implementation, JsonObject, ListPromptsRequestMethod, ListPromptsResult,
        ListResourcesRequestMethod, ListResourcesResult, ListToolsResult, PaginatedRequestParams,
        Prompt, PromptMessage, PromptsCapability, ReadResourceRequestMethod,
        ReadResourceRequestParams, ReadResourceResponse, ReadResourceResult, Resource,
        ResourceContents, ResourcesCapability, Role, ServerCapabilities, ServerConfig, Tool,
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

    /// The index of `lab://doc/<i>` when this lab serves it.
    fn document(&self, uri: &str) -> Option<usize> {
        let i: usize = uri.strip_prefix(DOC_PREFIX)?.parse().ok()?;
        (i < self.lab.documents).then_some(i)
    }
}

const DOC_PREFIX: &str = "lab://doc/";
const PROMPT: &str = "brief";

impl ServerHandler for EchoTools {
    fn get_info(&self) -> ServerConfig {
        let mut capabilities = ServerCapabilities::builder().enable_tools().build();
        if self.lab.documents > 0 {
            capabilities.resources = Some(ResourcesCapability::default());
            capabilities.prompts = Some(PromptsCapability::default());
        }
        ServerConfig::new(capabilities)
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

    async fn list_resources(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, ErrorData> {
        if self.lab.documents == 0 {
            return Err(ErrorData::method_not_found::<ListResourcesRequestMethod>());
        }
        let docs = (0..self.lab.documents)
            .map(|i| {
                Resource::new(format!("{DOC_PREFIX}{i}"), format!("doc{i}"))
                    .with_description("Lab document: about 1 KB of text.")
            })
            .collect();
        Ok(ListResourcesResult::with_all_items(docs))
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, ErrorData> {
        if self.lab.documents == 0 {
            return Err(ErrorData::method_not_found::<ReadResourceRequestMethod>());
        }
        let Some(i) = self.document(&request.uri) else {
            return Err(ErrorData::resource_not_found(
                format!("no resource {:?} on this lab", request.uri),
                None,
            ));
        };
        let text = format!(
            "Document {i} of lab instance {}. {}",
            self.lab.instance_id,
            "lorem ipsum ".repeat(80)
        );
        Ok(ReadResourceResult::new(vec![ResourceContents::text(text, request.uri)]).into())
    }

    async fn list_prompts(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListPromptsResult, ErrorData> {
        if self.lab.documents == 0 {
            return Err(ErrorData::method_not_found::<ListPromptsRequestMethod>());
        }
        let prompt = Prompt::new(
            PROMPT,
            Some("Lab prompt: asks for a brief of the lab's documents."),
            None,
        );
        Ok(ListPromptsResult::with_all_items(vec![prompt]))
    }

    async fn get_prompt(
        &self,
        request: GetPromptRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<GetPromptResponse, ErrorData> {
        if self.lab.documents == 0 {
            return Err(ErrorData::method_not_found::<GetPromptRequestMethod>());
        }
        if request.name != PROMPT {
            return Err(ErrorData::invalid_params(
                format!("unknown prompt {:?}", request.name),
                None,
            ));
        }
        let text = format!(
            "Write a brief of the {} documents of lab instance {}.",
            self.lab.documents, self.lab.instance_id
        );
        Ok(GetPromptResult::new(vec![PromptMessage::new_text(Role::User, text)]).into())
    }
}
