//! A request's way in: its headers read (an MCP POST, a GET stream, a DELETE, or nothing the
//! filter reads), the caller authenticated, the body held until whole and judged: one
//! request, a batch, a notification or a client's answer, each sent to its judge.

use super::*;

impl<S: SharedStore, M: MetricHost> Call<S, M> {
    pub fn on_request_headers(&mut self, host: &impl CallHost, end_of_stream: bool) -> Action {
        let action = self.request_headers(host, end_of_stream);
        self.gate(host, action)
    }

    fn request_headers(&mut self, host: &impl CallHost, end_of_stream: bool) -> Action {
        // Headers only this filter writes: the shared routes go to the cluster the first one
        // names (from the path it judges), the local-reply mapping reads the second. Removed
        // by name, whatever the value holds: one that is not UTF-8 is invisible to a lookup.
        for owned in [CLUSTER_HEADER, HELD_HEADER] {
            if host.request_header_present(owned) {
                host.set_request_header(owned, None);
            }
        }
        let Some(path) = host.request_header(":path") else {
            return Action::Continue;
        };
        let Some(target) = aggregate::target_of(&path) else {
            return Action::Continue;
        };
        if self.shared.borrow().unconfigured {
            return self.refuse_unconfigured(host, end_of_stream);
        }
        let method = match self.admit_headers(host) {
            Ok(method) => method,
            Err(refused) => return refused,
        };
        if let Target::Service(service) = target {
            route_to(host, service);
        }
        if let Some(refused) = self.authenticate(host, target) {
            return refused;
        }
        if let Target::Service(service) = target {
            if let Some(refused) = self.credential_for(host, service) {
                return refused;
            }
        }
        // The session as the client names it: what its cancellations are keyed by.
        self.client_session = host.request_header(SESSION_HEADER);
        let service = match target {
            Target::Service(service) => service,
            Target::Virtual { server, query } => {
                self.on_virtual = Some(OnVirtual {
                    server: server.to_string(),
                    query: query.to_string(),
                    routed: false,
                    method,
                    body: None,
                });
                // Whose held sessions toolgate-xds relays on a GET stream: this caller's only
                // (set or removed here, so no client names another user). Only toolgate-xds's
                // GET handler reads it: a call's POST pays no host call for it.
                if method == HttpMethod::Get {
                    host.set_request_header(
                        toolgate_model::session_owner::IDENTITY_HEADER,
                        self.held_identity().as_deref(),
                    );
                }
                // GET streams and DELETE are toolgate-xds's, with its own session ids: passed
                // untouched, never unsealed.
                if method != HttpMethod::Post {
                    return self.without_body(end_of_stream, false);
                }
                return self.hold_body(host, end_of_stream);
            }
        };
        self.open_session(host, service);
        match method {
            HttpMethod::Post => {}
            HttpMethod::Get => {
                self.service = Some(service.to_string());
                self.version = ProtocolVersion::from_header(
                    host.request_header("mcp-protocol-version").as_deref(),
                );
                return self.without_body(end_of_stream, true);
            }
            HttpMethod::Delete => return self.without_body(end_of_stream, false),
        }
        self.service = Some(service.to_string());
        self.hold_body(host, end_of_stream)
    }

    /// What every request on an MCP path must be before anything else is read: one of the
    /// transport's methods, headers the gateway reads in text, no claim header a client wrote,
    /// and no compression the filter could not read in the answer. `Err` is the refusal sent.
    pub(super) fn admit_headers(&mut self, host: &impl CallHost) -> Result<HttpMethod, Action> {
        let version =
            ProtocolVersion::from_header(host.request_header("mcp-protocol-version").as_deref());
        let method = host.request_header(":method").unwrap_or_default();
        let method = if method.eq_ignore_ascii_case("POST") {
            HttpMethod::Post
        } else if method.eq_ignore_ascii_case("GET") {
            HttpMethod::Get
        } else if method.eq_ignore_ascii_case("DELETE") {
            HttpMethod::Delete
        } else {
            self.version = version;
            let reply = reply::refused(version, None, Refusal::MethodNotAllowed, Framing::Json);
            return Err(self.send_local(host, 405, &reply, &[("allow", "GET, POST, DELETE")]));
        };
        if let Some(name) = READ_HEADERS
            .iter()
            .find(|name| host.request_header(name).is_none() && host.request_header_present(name))
        {
            self.version = version;
            return Err(self.refuse(host, 400, None, Refusal::HeaderNotText(name)));
        }
        // Headers a rule set copies verified claims into: whatever a client wrote there is
        // gone before a server could take it for the gateway's word, auth configuration or
        // not (the one a service asked for is put back from the verified token).
        {
            let shared = self.shared.borrow();
            for name in &shared.config.claim_header_names {
                if host.request_header_present(name) {
                    host.set_request_header(name, None);
                }
            }
        }
        // The filter reads every answer it judges: a compressed one it cannot, and would
        // then have to pass unjudged. Servers answer uncompressed when not asked otherwise.
        if host.request_header_present("accept-encoding") {
            host.set_request_header("accept-encoding", None);
        }
        Ok(method)
    }

    /// A GET or DELETE: its headers go on once it is clear no body follows them (a server
    /// that read a body there like a POST's would run a call nobody judged). `stream`: a GET
    /// stream of a service.
    pub(super) fn without_body(&mut self, end_of_stream: bool, stream: bool) -> Action {
        if end_of_stream {
            self.enter(if stream { Life::Stream } else { Life::Passed });
            return Action::Continue;
        }
        self.enter(Life::AwaitingEmptyBody { stream });
        Action::Pause
    }

    /// The GET or DELETE ended without a body: it goes on.
    fn empty_body_ended(&mut self, stream: bool) -> Action {
        self.enter(if stream { Life::Stream } else { Life::Passed });
        Action::Continue
    }

    /// The body of a GET or DELETE: refused if it has a byte; the request goes on once it has
    /// ended empty.
    pub(super) fn no_body_allowed(
        &mut self,
        host: &impl CallHost,
        stream: bool,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        if body_size > 0 {
            self.version = ProtocolVersion::from_header(
                host.request_header("mcp-protocol-version").as_deref(),
            );
            // The stream is refused, not judged: no breaker outcome, no stream watch.
            return self.refuse(host, 400, None, Refusal::BodyNotAllowed);
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.empty_body_ended(stream)
    }

    /// A POST to judge: reads what the headers say, and holds them until the body is complete.
    pub(super) fn hold_body(&mut self, host: &impl CallHost, end_of_stream: bool) -> Action {
        self.version =
            ProtocolVersion::from_header(host.request_header("mcp-protocol-version").as_deref());
        self.framing = Framing::from_accept(host.request_header("accept").as_deref());
        let mut read = Reading {
            header_method: host.request_header("mcp-method"),
            header_name: host.request_header("mcp-name"),
            ..Reading::default()
        };
        if host
            .request_header("content-encoding")
            .is_some_and(|e| !e.trim().eq_ignore_ascii_case("identity"))
        {
            return self.refuse(host, 415, None, Refusal::Encoded);
        }
        let limit = self.shared.borrow().config.max_body_bytes;
        let declared = host
            .request_header("content-length")
            .and_then(|v| v.trim().parse::<u64>().ok());
        read.declared_length = declared.is_some();
        self.enter(Life::Reading(read));
        if declared.is_some_and(|n| n > limit) {
            let reply = reply::body_too_large(self.version, None, limit, self.framing);
            return self.reply_locally(host, 413, &reply);
        }
        if end_of_stream {
            return self.refuse(host, 400, None, Refusal::Empty);
        }
        // Hold the headers until the body says what is called.
        Action::Pause
    }

    pub fn on_request_body(
        &mut self,
        host: &impl CallHost,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        let action = self.request_body(host, body_size, end_of_stream);
        self.gate(host, action)
    }

    fn request_body(
        &mut self,
        host: &impl CallHost,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        let read = match &mut self.life {
            Life::AwaitingEmptyBody { stream } => {
                let stream = *stream;
                return self.no_body_allowed(host, stream, body_size, end_of_stream);
            }
            Life::Unconfigured { .. } => {
                return self.unconfigured_body(host, body_size, end_of_stream)
            }
            Life::Reading(read) => read,
            _ => return Action::Continue,
        };
        read.body_len = body_size;
        let limit = self.shared.borrow().config.max_body_bytes;
        if body_size as u64 > limit {
            let reply = reply::body_too_large(self.version, None, limit, self.framing);
            return self.reply_locally(host, 413, &reply);
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.judge(host)
    }

    /// HTTP/2 trailers end the request without an end-of-stream body callback: the body is
    /// complete now, and must be judged before Envoy forwards it.
    pub fn on_request_trailers(&mut self, host: &impl CallHost) -> Action {
        let action = match &self.life {
            // Trailers end the request: whatever body came was seen by the body callbacks.
            Life::AwaitingEmptyBody { stream } => self.empty_body_ended(*stream),
            Life::Unconfigured { body_len } => self.unconfigured_body(host, *body_len, true),
            Life::Reading(_) => self.judge(host),
            _ => Action::Continue,
        };
        self.gate(host, action)
    }

    /// Sends a local reply and stops the request there.
    pub(super) fn reply_locally(
        &mut self,
        host: &impl CallHost,
        status: u32,
        reply: &Reply,
    ) -> Action {
        self.send_local(host, status, reply, &[])
    }

    pub(super) fn refuse(
        &mut self,
        host: &impl CallHost,
        status: u32,
        id: Option<&RawId>,
        refusal: Refusal,
    ) -> Action {
        let reply = reply::refused(self.version, id, refusal, self.framing);
        self.reply_locally(host, status, &reply)
    }

    /// The body is complete: judge it.
    pub(super) fn judge(&mut self, host: &impl CallHost) -> Action {
        let read = match &mut self.life {
            Life::Reading(read) => std::mem::take(read),
            _ => return Action::Continue,
        };
        let body_len = read.body_len;
        self.enter(Life::Judged(Exchange::new(read)));
        // A service's route, or (no service yet) the aggregate endpoint.
        let service = self.service.clone();
        if service.is_none() && self.on_virtual.is_none() {
            return Action::Continue;
        }
        let bytes = host.request_body(body_len).unwrap_or_default();
        let depth = self.shared.borrow().config.max_json_depth;
        if nests_deeper_than(&bytes, depth) {
            let reply = reply::too_deep(self.version, depth, self.framing);
            return self.reply_locally(host, 400, &reply);
        }
        let body = match read_body(&bytes) {
            Ok(body) => body,
            Err(refusal) => return self.refuse(host, 400, None, refusal),
        };
        let check = match self.read() {
            Some(read) => check_headers(
                read.header_method.as_deref(),
                read.header_name.as_deref(),
                &body,
            ),
            None => HeaderCheck::NoHeaders,
        };
        if let HeaderCheck::Mismatch(mismatch) = check {
            let id = match &body {
                Body::Request(r) => Some(&r.id),
                _ => None,
            };
            let reply = reply::header_mismatch(self.version, id, mismatch, self.framing);
            return self.reply_locally(host, 400, &reply);
        }
        // What goes on to toolgate-xds (everything but a call) is kept, should no toolgate-xds
        // answer it.
        if let Some(on) = self.on_virtual.as_mut() {
            if !matches!(&body, Body::Request(r) if r.method == TOOLS_CALL) {
                on.body = Some(bytes.to_vec());
            }
            // toolgate-xds passes these on to the sessions held for this caller only: named
            // here (or a name the client wrote removed), as for a GET stream.
            let per_caller = match &body {
                Body::Notification { method } => method == cancel::METHOD,
                Body::Request(r) => r.method == SET_LEVEL,
                _ => false,
            };
            if per_caller {
                host.set_request_header(
                    toolgate_model::session_owner::IDENTITY_HEADER,
                    self.held_identity().as_deref(),
                );
            }
        }
        if self.sealing && self.on_virtual.is_none() {
            if let Body::Request(r) = &body {
                if r.method == "initialize" {
                    self.init_params = held_session::initialize_params(&bytes);
                }
            }
            // Kept for a replay, should the server no longer know the session.
            if let Some(h) = self.held.as_mut() {
                h.body = bytes.to_vec();
            }
        }
        match (body, service) {
            (Body::Request(request), Some(service)) => self.judge_request(host, &service, request),
            (Body::Request(request), None) => self.judge_virtual(host, request, &bytes),
            (Body::Batch(elements), Some(service)) => self.judge_batch(host, &service, elements),
            (Body::Batch(elements), None) => self.judge_virtual_batch(host, &elements),
            (Body::Notification { method }, _) => {
                self.log_field(host, log_field::METHOD, &method);
                if method == cancel::METHOD {
                    self.note_cancellation(host, &bytes);
                }
                Action::Continue
            }
            (Body::Response, None) => self.route_answer(host, &bytes),
            (Body::Response, Some(_)) => Action::Continue,
        }
    }
}
