//! The aggregate endpoint (`/mcp`, `/virtual/<name>`): names looked up in the virtual
//! server's routes, requests rewritten with the server's own names and sent to the
//! service's route, and a client's answers and cancellations sent where they belong.

use super::*;

/// MCP's error code for a resource no server has.
pub(super) const RESOURCE_NOT_FOUND: i64 = -32002;

/// What a listing lists, as rules name it.
pub(super) fn item_listed(listing: Listing) -> Item {
    match listing {
        Listing::Tools => Item::Tool,
        Listing::Resources | Listing::Templates => Item::Resource,
        Listing::Prompts => Item::Prompt,
    }
}

/// The service and its own name (tool, prompt, URI, template) of an item a virtual server
/// lists as `visible`; `None` for one it does not route.
pub(super) fn routed(
    routes: &VirtualRoutes,
    listing: Listing,
    visible: &str,
) -> Option<(String, String)> {
    let target = |t: &VirtualTool| (t.service.clone(), t.tool.clone());
    match listing {
        Listing::Tools => routes.tools.get(visible).map(target),
        Listing::Prompts => routes.prompts.get(visible).map(target),
        Listing::Resources => routes.resources.get(visible).map(target),
        Listing::Templates => routes
            .templates
            .iter()
            .find(|t| t.visible == visible)
            .map(|t| {
                let own = match unprefixed_uri(visible) {
                    Some((service, inner)) if service == t.service => inner,
                    _ => visible,
                };
                (t.service.clone(), own.to_string())
            }),
    }
}

/// A JSON-RPC message (a client's answer) with `id` in place of its own; `None` when it is
/// not one object.
pub(super) fn with_id(body: &[u8], id: serde_json::Value) -> Option<Vec<u8>> {
    let mut message: serde_json::Value = serde_json::from_slice(body).ok()?;
    *message.as_object_mut()?.get_mut("id")? = id;
    serde_json::to_vec(&message).ok()
}

/// The prompts and resources a request is about, as rules name them (none for a request
/// about neither). A `completion/complete` whose `ref` cannot be read is about both, unnamed:
/// where either is guarded, it is refused rather than passed unjudged.
pub(super) fn surface_items<'r>(request: &'r Request<'_>) -> Vec<(Item, Cow<'r, str>)> {
    let method = request.method.as_ref();
    let name = |n: &'r Option<Cow<'_, str>>| n.as_deref().map_or(Cow::Borrowed(""), Cow::Borrowed);
    if method == PROMPTS_GET {
        return vec![(Item::Prompt, name(&request.params_name))];
    }
    if [RESOURCES_READ, RESOURCES_SUBSCRIBE, RESOURCES_UNSUBSCRIBE].contains(&method) {
        return vec![(Item::Resource, name(&request.params_uri))];
    }
    if method != COMPLETION_COMPLETE {
        return Vec::new();
    }
    match request.params_ref_raw.and_then(completion_ref) {
        Some(CompletionRef::Prompt { name, .. }) => vec![(Item::Prompt, name)],
        Some(CompletionRef::Resource { uri, .. }) => vec![(Item::Resource, uri)],
        None => vec![
            (Item::Prompt, Cow::Borrowed("")),
            (Item::Resource, Cow::Borrowed("")),
        ],
    }
}

pub(super) struct OnVirtual {
    pub(super) server: String,
    /// The query of the agent's path (`?` included), kept on the service's path.
    pub(super) query: String,
    /// A `tools/call` sent to its service's route.
    pub(super) routed: bool,
    pub(super) method: HttpMethod,
    /// The body of a POST that goes to toolgate-xds, kept should no toolgate-xds answer
    /// (see [`crate::offline`]).
    pub(super) body: Option<Vec<u8>>,
}

impl<S: SharedStore, M: MetricHost> Call<S, M> {
    /// A client's answer on the aggregate endpoint to a question a server asked during a call
    /// (`crate::asked`): sent to that service's route on the session held for the client. An
    /// answer to nothing noted goes on to toolgate-xds, which accepts it (202) as a server
    /// would an answer it no longer waits for.
    pub(super) fn route_answer(&mut self, host: &impl CallHost, bytes: &[u8]) -> Action {
        self.log_field(host, log_field::METHOD, "response");
        let (Some(session), Some(id)) = (&self.client_session, asked::response_id(bytes)) else {
            return Action::Continue;
        };
        let service = {
            let shared = self.shared.borrow();
            asked::asker(shared.breakers.store(), session, &id, host.now_ms())
        };
        let Some(service) = service else {
            host.log(
                Level::Info,
                &format!(
                    "toolgate: an answer with id {} on the aggregate endpoint matches no server's question; dropped",
                    asked::shown(&id)
                ),
            );
            return Action::Continue;
        };
        // As for its questions' calls: no token, no session of that service's.
        if self.lacks_token_for(&service) {
            let what = format!("the MCP endpoint `{}`", self.endpoint_shown());
            return self.refuse_unauthenticated(host, &service, &what, None);
        }
        self.forward_claims(host, &service);
        self.service = Some(service.clone());
        // The server gets its answer under the id it gave its question.
        let own = serde_json::from_str::<serde_json::Value>(&id)
            .ok()
            .and_then(|shown| asked::own_id(&shown).map(|(s, own)| (s == service, own)));
        match own {
            Some((true, own)) => match with_id(bytes, own) {
                Some(body) => self.route_call(host, &body, &service, ""),
                None => Action::Continue,
            },
            _ => self.route_call(host, bytes, &service, ""),
        }
    }

    /// The aggregate endpoint this request came to, as its client wrote the path.
    pub(super) fn endpoint_shown(&self) -> String {
        let server = self
            .on_virtual
            .as_ref()
            .map_or(toolgate_model::virtual_server::DEFAULT_VIRTUAL, |v| {
                v.server.as_str()
            });
        aggregate::endpoint_path(server)
    }

    /// A scanner noting the server's questions, for the SSE answer to a request routed from
    /// the aggregate endpoint on a client's session (where an answer needs finding its way
    /// back); `None` for any other.
    pub(super) fn question_scanner<H: CallHost>(
        &self,
        head: &AnswerHead<'_, H>,
    ) -> Option<SseScanner> {
        let routed = self.on_virtual.as_ref().is_some_and(|v| v.routed);
        if !routed || self.client_session.is_none() || !head.is_sse() {
            return None;
        }
        let judged = self.judged()?;
        Some(SseScanner::new(judged.id.clone()).noting_requests())
    }

    /// Notes which service asked the client of this call the questions `ids` (see
    /// `crate::asked`), so that the client's answers reach it.
    pub(super) fn note_questions(&self, host: &impl CallHost, ids: Vec<String>) {
        if ids.is_empty() {
            return;
        }
        let (Some(session), Some(service)) = (&self.client_session, &self.service) else {
            return;
        };
        let shared = self.shared.borrow();
        for id in ids {
            let noted = asked::note(
                shared.breakers.store(),
                session,
                &id,
                service,
                host.now_ms(),
            );
            let id = asked::shown(&id);
            match noted {
                asked::Noted::Noted => {}
                asked::Noted::Replaced { earlier } => host.log(
                    Level::Warn,
                    &format!(
                        "toolgate: services {earlier:?} and {service:?} both asked one client session a question with id {id}; its answer goes to {service:?}, and {earlier:?} waits in vain"
                    ),
                ),
                asked::Noted::Failed => host.log(
                    Level::Warn,
                    &format!(
                        "toolgate: could not note that service {service:?} asked a question with id {id}; the client's answer will not reach it"
                    ),
                ),
            }
        }
    }

    /// A client cancelled one of its calls: noted for every worker, so the call's end is
    /// not held against its tool.
    pub(super) fn note_cancellation(&self, host: &impl CallHost, body: &[u8]) {
        let (Some(session), Some(id)) = (&self.client_session, cancel::request_id(body)) else {
            return;
        };
        let shared = self.shared.borrow();
        cancel::mark(shared.breakers.store(), session, &id, host.now_ms());
    }

    /// A request on the aggregate endpoint. Only `tools/call` is the filter's: the name is
    /// looked up in the virtual server's names, the call judged as one of its (service, tool)
    /// and sent to that service's route with the tool's own name. Anything else goes on to
    /// toolgate-xds as it is.
    pub(super) fn judge_virtual(
        &mut self,
        host: &impl CallHost,
        request: Request<'_>,
        bytes: &[u8],
    ) -> Action {
        if [
            PROMPTS_GET,
            RESOURCES_READ,
            RESOURCES_SUBSCRIBE,
            RESOURCES_UNSUBSCRIBE,
            COMPLETION_COMPLETE,
        ]
        .contains(&request.method.as_ref())
        {
            self.log_field(host, log_field::METHOD, &request.method);
            self.note_request(Judged {
                id: request.id.clone(),
                discover: false,
                tool: None,
                list: None,
            });
            return self.route_surface(host, &request, bytes);
        }
        let visible = match self.called_tool(host, &request) {
            Ok(Some(tool)) => tool,
            Ok(None) => return Action::Continue,
            Err(answered) => return answered,
        };
        let Some(server) = self.on_virtual.as_ref().map(|v| v.server.clone()) else {
            return Action::Continue;
        };
        let found = {
            let shared = self.shared.borrow();
            match shared.config.virtual_servers.get(&server) {
                None => Err(Refused::NoVirtualServer(server.clone())),
                Some(routes) => match routes.tools.get(visible) {
                    Some(t) => Ok((t.service.clone(), t.tool.clone())),
                    None => Err(Refused::NotOffered {
                        endpoint: aggregate::endpoint_path(&server),
                        tool: visible.to_string(),
                    }),
                },
            }
        };
        let (service, tool) = match found {
            Ok(found) => found,
            Err(refused) => {
                self.record_decision(host, &Judgement::Refuse(refused.clone()));
                let reply = refused.reply(self.version, &request.id, self.framing);
                return self.reply_locally(host, 200, &reply);
            }
        };
        // The body the service gets, made before anything is decided: a name that cannot be
        // replaced exactly never reaches a server (nor takes a breaker's trial slot).
        let routed = request
            .params_name_raw
            .and_then(|raw| aggregate::span_in(bytes, raw))
            .and_then(|span| aggregate::with_name(bytes, span, &tool));
        let Some(routed) = routed else {
            return self.refuse(host, 200, Some(&request.id), Refusal::ToolNameAbsent);
        };
        self.log_field(host, log_field::TOOL, &tool);
        self.log_field(host, log_field::SERVICE, &service);
        if let Some(refused) = self.authorize(
            host,
            Item::Tool,
            &service,
            &tool,
            Some((&server, visible)),
            &request.id,
        ) {
            return refused;
        }
        self.forward_claims(host, &service);
        self.service = Some(service.clone());
        self.watch_links(&server, &service);
        let judgement = self.verdict_on(host, &service, &tool);
        self.record_decision(host, &judgement);
        match judgement {
            Judgement::Refuse(refused) => {
                let refused =
                    refused.seen_on(&server, visible, &service, &self.shared.borrow().visible);
                let reply = refused.reply(self.version, &request.id, self.framing);
                self.reply_locally(host, 200, &reply)
            }
            Judgement::Pass => self.route_call(host, &routed, &service, &tool),
            Judgement::Admit(admitted) => {
                let fallback = admitted.policy.fallback_tool.as_deref().and_then(|f| {
                    let shared = self.shared.borrow();
                    shared.visible.get(&server, &service, f).map(str::to_string)
                });
                self.admit(admitted, (visible.to_string(), fallback));
                self.route_call(host, &routed, &service, &tool)
            }
        }
    }

    /// Has the answer's resource links shown as `server` shows `service`'s resources, when
    /// that virtual server offers any (else no URI of them could lead elsewhere).
    pub(super) fn watch_links(&mut self, server: &str, service: &str) {
        let offers = self
            .shared
            .borrow()
            .config
            .virtual_servers
            .get(server)
            .is_some_and(|r| !r.resources.is_empty() || !r.templates.is_empty());
        if let (true, Some(exchange)) = (offers, self.exchange_mut()) {
            exchange.edit = Some(AnswerEdit {
                server: server.to_string(),
                service: service.to_string(),
                links: true,
                questions: false,
                sse: false,
            });
        }
    }

    /// A request about one prompt or one resource on the aggregate endpoint (`prompts/get`,
    /// `resources/read`, `resources/subscribe` / `unsubscribe`, and `completion/complete` by
    /// the prompt or resource it completes): the prompt's name (or the URI) looked up in the
    /// virtual server's routes, put back as its server wrote it, and the request sent to that
    /// service's route like a call (the session held for the client, the service's limits),
    /// with no breaker: its answer counts only in the health feedback.
    pub(super) fn route_surface(
        &mut self,
        host: &impl CallHost,
        request: &Request<'_>,
        bytes: &[u8],
    ) -> Action {
        let Some(server) = self.on_virtual.as_ref().map(|v| v.server.clone()) else {
            return Action::Continue;
        };
        let completed = if request.method == COMPLETION_COMPLETE {
            request.params_ref_raw.and_then(completion_ref)
        } else {
            None
        };
        let (prompt, asked, raw) = match &completed {
            Some(CompletionRef::Prompt { name, raw }) => (true, Some(name.as_ref()), Some(*raw)),
            Some(CompletionRef::Resource { uri, raw }) => (false, Some(uri.as_ref()), Some(*raw)),
            None if request.method == COMPLETION_COMPLETE => (false, None, None),
            None if request.method == PROMPTS_GET => (
                true,
                request.params_name.as_deref(),
                request.params_name_raw,
            ),
            None => (false, request.params_uri.as_deref(), request.params_uri_raw),
        };
        let (Some(asked), Some(raw)) = (asked, raw) else {
            let field = if request.method == COMPLETION_COMPLETE {
                "params.ref must be {\"type\": \"ref/prompt\", \"name\": <string>} or \
                 {\"type\": \"ref/resource\", \"uri\": <string>}"
            } else if prompt {
                "params.name must be a string"
            } else {
                "params.uri must be a string"
            };
            let message = format!("{}: {field}", request.method);
            let reply = reply::error(
                self.version,
                Some(&request.id),
                crate::mcp::request::INVALID_PARAMS,
                &message,
                None::<()>,
                self.framing,
            );
            return self.reply_locally(host, 200, &reply);
        };
        let found = {
            let shared = self.shared.borrow();
            shared
                .config
                .virtual_servers
                .get(&server)
                .and_then(|routes| {
                    if prompt {
                        routes
                            .prompts
                            .get(asked)
                            .map(|t| (t.service.clone(), t.tool.clone()))
                    } else {
                        routes.resource_target(asked)
                    }
                })
        };
        let Some((service, own)) = found else {
            let endpoint = aggregate::endpoint_path(&server);
            let (code, message) = if prompt {
                (
                    crate::mcp::request::INVALID_PARAMS,
                    format!(
                        "Unknown prompt: this endpoint (`{endpoint}`) offers no prompt `{asked}`. \
                         Call prompts/list for the prompts it has."
                    ),
                )
            } else {
                (
                    RESOURCE_NOT_FOUND,
                    format!(
                        "Resource not found: no service of this endpoint (`{endpoint}`) offers \
                         `{asked}`. Call resources/list and resources/templates/list for what it has."
                    ),
                )
            };
            let reply = reply::error(
                self.version,
                Some(&request.id),
                code,
                &message,
                None::<()>,
                self.framing,
            );
            return self.reply_locally(host, 200, &reply);
        };
        let routed =
            aggregate::span_in(bytes, raw).and_then(|span| aggregate::with_name(bytes, span, &own));
        let Some(routed) = routed else {
            return self.refuse(host, 200, Some(&request.id), Refusal::ToolNameAbsent);
        };
        // Judged by the rules of the service and of this virtual server, as on the service's
        // own route: a service that requires a token for its tools requires one here too, and
        // a prompt or resource its rules guard needs a rule granting it.
        let item = if prompt { Item::Prompt } else { Item::Resource };
        if let Some(refused) = self.authorize(
            host,
            item,
            &service,
            &own,
            Some((&server, asked)),
            &request.id,
        ) {
            return refused;
        }
        // The service's limits count it as on the service's own route.
        if self.has_limits(&service) {
            if let Some(over) = self.over_limit(host, &service, None) {
                return self.refuse_over_limit(host, &request.id, &over);
            }
        }
        self.forward_claims(host, &service);
        self.service = Some(service.clone());
        let rewritten_uri = (request.method == RESOURCES_READ && own != asked)
            .then(|| (own.clone(), asked.to_string()));
        if let Some(exchange) = self.exchange_mut() {
            exchange.surface = Some(Surface { rewritten_uri });
        }
        if request.method == PROMPTS_GET {
            self.watch_links(&server, &service);
        }
        self.route_call(host, &routed, &service, &own)
    }

    /// Sends a call made on the aggregate endpoint to its service's own route, `/mcp/<service>`,
    /// so that Envoy applies that route (cluster, path rewrite, timeouts, retries, bulkhead),
    /// with `body` (the agent's, with the tool's own name).
    pub(super) fn route_call(
        &mut self,
        host: &impl CallHost,
        body: &[u8],
        service: &str,
        tool: &str,
    ) -> Action {
        let (body_len, declared_length, header_name) = match self.read() {
            Some(r) => (r.body_len, r.declared_length, r.header_name.is_some()),
            None => (0, false, false),
        };
        if let Some(refused) = self.credential_for(host, service) {
            return refused;
        }
        let Some(on) = &mut self.on_virtual else {
            return Action::Continue;
        };
        on.routed = true;
        host.set_request_body(body_len, body);
        if declared_length {
            host.set_request_header("content-length", Some(&body.len().to_string()));
        }
        if header_name {
            host.set_request_header("mcp-name", Some(tool));
        }
        // The agent's `Mcp-Session-Id` is a gateway session of toolgate-xds, which no server
        // knows: it is exchanged for the session the gateway holds with this service for it
        // (see `crate::held_session`), or dropped (a 2026-07-28 client has none, and gets
        // one held for its stated identity when the server needs one).
        let gateway_session = host
            .request_header(SESSION_HEADER)
            .filter(|id| id.starts_with(held_session::GATEWAY_PREFIX));
        host.set_request_header(SESSION_HEADER, None);
        let query = on.query.clone();
        // Envoy picked a route for the agent's path before this filter ran. Its wasm host drops
        // that choice whenever a plugin sets a request header, so the router picks again, by
        // this path: verified with Envoy 1.40.0 (tests/tests/aggregate_calls.rs passes with a
        // filter build that does nothing more, where `/mcp` has no route of its own). Should
        // a later Envoy stop doing so (envoyproxy/envoy#36671 meant to), that test fails with
        // a 404, and the remedy is its foreign function `clear_route_cache`
        // (`hostcalls::call_foreign_function("clear_route_cache", None)`), one host call.
        host.set_request_header(":path", Some(&aggregate::service_path(service, &query)));
        route_to(host, service);
        let identity = self.held_identity();
        let (owner, client) = match gateway_session {
            Some(id) => match held_session::owner_of(held_session::OwnerKind::Gateway, &id) {
                Some(owner) => (
                    held_session::bound_to(owner, identity.as_deref()),
                    HeldFor::Gateway { session_id: id },
                ),
                None => return Action::Continue,
            },
            // A 2026-07-28 client calling a server that needs a session: one held for the
            // identity it states. Any other call without a gateway session goes as it is
            // (one map lookup: the common stateless case pays no more).
            None => {
                let revision = (self.version >= ProtocolVersion::V2026_07_28)
                    .then(|| {
                        self.shared
                            .borrow()
                            .config
                            .legacy_revisions
                            .get(service)
                            .cloned()
                    })
                    .flatten();
                let Some(revision) = revision else {
                    return Action::Continue;
                };
                let params = held_session::stateless_params(body, &revision);
                (
                    held_session::bound_to(
                        held_session::owner_of_identity(&params),
                        identity.as_deref(),
                    ),
                    HeldFor::Stateless {
                        init_params: params,
                    },
                )
            }
        };
        let slot = held_session::slot_key(&owner, service);
        let cached = {
            let shared = self.shared.borrow();
            shared
                .breakers
                .store()
                .get(&slot)
                .ok()
                .flatten()
                .and_then(|(bytes, _)| held_session::decode_slot(&bytes, &owner, service))
        };
        // An answer asked for long ago is asked for again (toolgate-xds learns the session is
        // in use), and used still should toolgate-xds not answer.
        let (cached, fallback) = match cached {
            Some(held_session::Slot::Held {
                held: answer,
                asked_ms,
            }) if host.now_ms().saturating_sub(asked_ms) < held_session::REFRESH_MS => {
                (Some(answer), None)
            }
            Some(held_session::Slot::Held { held: answer, .. }) => (None, Some(answer)),
            Some(held_session::Slot::Ended) => return self.session_ended_here(host),
            None => (None, None),
        };
        let mut held = HeldCall {
            owner,
            service: service.to_string(),
            client,
            slot,
            envelope: None,
            body: body.to_vec(),
            phase: HeldPhase::Sent,
            fallback,
            opened_ms: None,
            unsessioned: false,
        };
        if let Some(answer) = cached {
            held.use_answer(host, &answer);
            self.held = Some(held);
            return Action::Continue;
        }
        let caller = self.held_caller(host);
        let request = held_session::open_request(&held.question(&caller));
        held.phase = HeldPhase::Opening;
        self.held = Some(held);
        if host
            .dispatch(
                held_session::OPEN_PATH,
                &request,
                &self.report_authorization(),
            )
            .is_some()
        {
            return Action::Pause;
        }
        // Not even asked (Envoy knows no control cluster to send to): as if unanswered.
        self.mark_unsessioned();
        Action::Continue
    }

    /// A 2025-03-26 batch on the aggregate endpoint: one request goes to one place, so a batch
    /// with a `tools/call` is refused whole (each call told to come alone); one without goes
    /// on to toolgate-xds.
    pub(super) fn judge_virtual_batch(
        &mut self,
        host: &impl CallHost,
        elements: &[Body<'_>],
    ) -> Action {
        if self.version > ProtocolVersion::V2025_03_26 {
            return self.refuse(host, 400, None, Refusal::BatchNotAllowed);
        }
        self.log_field(host, log_field::METHOD, "batch");
        let requests = elements.iter().filter_map(|e| match e {
            Body::Request(r) => Some(r),
            _ => None,
        });
        if !requests.clone().any(|r| r.method == TOOLS_CALL) {
            return Action::Continue;
        }
        let batch: Vec<BatchAnswer<'_>> = requests
            .map(|r| {
                if r.method == TOOLS_CALL {
                    BatchAnswer::Error(
                        &r.id,
                        crate::mcp::request::INVALID_REQUEST,
                        reply::BATCHED_VIRTUAL_CALL,
                    )
                } else {
                    BatchAnswer::NotRun(&r.id)
                }
            })
            .collect();
        let reply = reply::batch_refused(self.version, &batch, self.framing);
        self.reply_locally(host, 200, &reply)
    }

    /// Records the request; for a `tools/call`, the tool it names (`Ok(None)`: another
    /// method). A name that is missing or breaks the rule is answered here (`Err`).
    pub(super) fn called_tool<'r>(
        &mut self,
        host: &impl CallHost,
        request: &'r Request<'_>,
    ) -> Result<Option<&'r str>, Action> {
        self.log_field(host, log_field::METHOD, &request.method);
        self.note_request(Judged {
            id: request.id.clone(),
            discover: request.method == SERVER_DISCOVER,
            tool: None,
            list: None,
        });
        if request.method != TOOLS_CALL {
            // A service's tool listing is annotated; any listing is filtered to what the
            // caller may use once rules guard what it lists.
            let listing = Listing::of_method(&request.method).filter(|&listing| {
                (listing == Listing::Tools && self.on_virtual.is_none())
                    || self.listing_filtered_for(listing)
            });
            if let Some(judged) = self.exchange_mut().and_then(|e| e.request.as_mut()) {
                judged.list = listing;
            }
            return Ok(None);
        }
        match request.tool() {
            Some(ToolName::Valid(tool)) => Ok(Some(tool)),
            Some(ToolName::Invalid(_)) => {
                Err(self.refuse(host, 200, Some(&request.id), Refusal::ToolNameInvalid))
            }
            _ => Err(self.refuse(host, 200, Some(&request.id), Refusal::ToolNameAbsent)),
        }
    }
}
