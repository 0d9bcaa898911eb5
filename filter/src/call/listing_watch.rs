//! Listings as they come back: a server's `tools/list` annotated and filtered for the
//! caller, GET streams, and the answers the filter gives itself when toolgate-xds is gone.

use super::*;

impl<S: SharedStore, M: MetricHost> Call<S, M> {
    /// A request of the aggregate endpoint that no toolgate-xds answered (Envoy found none
    /// healthy, or could not connect): answered here, in MCP, from the configuration (see
    /// [`crate::offline`]), never with Envoy's plain-text 503. A toolgate-xds's own error
    /// passes as it is.
    pub(super) fn control_plane_unreachable<H: CallHost>(
        &mut self,
        host: &H,
        head: &AnswerHead<'_, H>,
        end_of_stream: bool,
    ) -> Option<Action> {
        let status = head.status();
        if status < 500 {
            return None;
        }
        let overloaded = host.response_header("x-envoy-overloaded").is_some();
        let details = self.code_details(host);
        match verdict(status, overloaded, &details) {
            Verdict::Failed(UpstreamFailure::Http5xx(_)) => return None,
            Verdict::Failed(_) | Verdict::Overloaded => {}
            Verdict::Answered | Verdict::ClientError => return None,
        }
        let on = self.on_virtual.as_mut()?;
        let (status, reply, session) = match on.method {
            HttpMethod::Get => {
                let reply = reply::error(
                    self.version,
                    None,
                    reply::INTERNAL_ERROR,
                    "The gateway's control plane is unreachable: the stream of changes to the \
                     tool list cannot be opened now. Tools can still be called.",
                    None::<()>,
                    Framing::Json,
                );
                return Some(self.unavailable(host, reply, end_of_stream));
            }
            // The session ends with the client; toolgate-xds forgets it when idle.
            HttpMethod::Delete => (
                200,
                Reply {
                    body: Vec::new(),
                    content_type: "application/json",
                },
                None,
            ),
            HttpMethod::Post => {
                let raw = on.body.take().unwrap_or_default();
                let server = on.server.clone();
                let body = read_body(&raw).ok()?;
                let shared = self.shared.borrow();
                let mut listing = shared.config.offline_listings.get(&server).cloned();
                // Shown to this caller as toolgate-xds's listing would be: only what it may call.
                if let (Some(tools), Some(auth)) = (listing.as_mut(), shared.config.auth.as_ref()) {
                    if self.listing_filtered_for(Listing::Tools) {
                        let routes = shared.config.virtual_servers.get(&server);
                        tools.retain(|tool| {
                            let name = tool["name"].as_str().unwrap_or_default();
                            routes
                                .and_then(|r| routed(r, Listing::Tools, name))
                                .is_some_and(|(service, own)| {
                                    self.may_list(
                                        auth,
                                        Item::Tool,
                                        &service,
                                        &own,
                                        Some((&server, name)),
                                    )
                                })
                        });
                    }
                }
                let ctx = offline::Context {
                    server: &server,
                    listing: listing.as_deref(),
                    version: self.version,
                    framing: self.framing,
                    now_ms: host.now_ms(),
                };
                let sealer = shared.sealer.as_ref();
                match offline::answer(&ctx, &body, &raw, |plain| {
                    sealer?.seal_as(offline::GATEWAY_PREFIX, offline::GATEWAY_AAD, plain)
                }) {
                    offline::Answer::Reply { reply, session } => (200, reply, session),
                    offline::Answer::Accepted => (
                        202,
                        Reply {
                            body: Vec::new(),
                            content_type: "application/json",
                        },
                        None,
                    ),
                }
            }
        };
        self.shared.borrow_mut().stats.count(OFFLINE_ANSWERS);
        if end_of_stream {
            let headers: Vec<(&str, &str)> = session
                .as_deref()
                .map(|id| vec![(SESSION_HEADER, id)])
                .unwrap_or_default();
            return Some(self.send_local(host, status, &reply, &headers));
        }
        replacing(host, &status.to_string(), reply.content_type);
        host.set_response_header(SESSION_HEADER, session.as_deref());
        self.watch = Watch::Replace(reply);
        Some(Action::Continue)
    }

    /// A server's answer to a `tools/list` on its route: held to be annotated, as long as it
    /// is small enough to hold ([`HOLD_LIMIT`], like a call's JSON response).
    pub(super) fn watch_listing<H: CallHost>(
        &mut self,
        host: &H,
        head: &AnswerHead<'_, H>,
    ) -> Action {
        let content_type = head.content_type();
        if head.is_sse() {
            // An annotated event is longer than the server's: a declared length would cut it.
            host.set_response_header("content-length", None);
            self.watch = Watch::Listing { sse: true };
            if self.listing_filtered() {
                // Held with its headers: should the stream prove unreadable, it is replaced
                // whole, as a JSON listing is, rather than shown unfiltered.
                return Action::Pause;
            }
            return Action::Continue;
        }
        let declared = host
            .response_header("content-length")
            .and_then(|v| v.trim().parse::<usize>().ok());
        if !content_type.starts_with("application/json") || declared.is_some_and(|n| n > HOLD_LIMIT)
        {
            self.shared.borrow_mut().stats.count(TOOLS_LIST_UNREAD);
            if self.listing_filtered() {
                // Filtered or not shown: read it whole to replace it.
                self.watch = Watch::Listing { sse: false };
                return Action::Pause;
            }
            return Action::Continue;
        }
        self.watch = Watch::Listing { sse: false };
        // The length is set once the body is read: it changes only if a tool is annotated.
        Action::Pause
    }

    /// The held `tools/list` answer (`body_size` bytes so far): annotated when complete, or
    /// passed on as it is when it is too large or not a listing.
    pub(super) fn listing_body(
        &mut self,
        host: &impl CallHost,
        sse: bool,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        if body_size > HOLD_LIMIT {
            self.watch = Watch::None;
            self.shared.borrow_mut().stats.count(TOOLS_LIST_UNREAD);
            if self.listing_filtered() {
                if !end_of_stream {
                    // Held to the end, then replaced: it cannot be filtered.
                    self.watch = Watch::Listing { sse: false };
                    return Action::Pause;
                }
                return self.unfilterable_listing(host, body_size);
            }
            return Action::Continue;
        }
        if !sse && !end_of_stream {
            return Action::Pause;
        }
        let Some(judged) = self.judged() else {
            self.watch = Watch::None;
            return Action::Continue;
        };
        let body = host.response_body(body_size).unwrap_or_default();
        let now = host.now_ms();
        let (listed, filtered) = {
            let shared = self.shared.borrow();
            let auth = shared.config.auth.as_ref();
            let server = self.on_virtual.as_ref().map(|v| v.server.as_str());
            let routes = server.and_then(|s| shared.config.virtual_servers.get(s));
            let service = self.service.as_deref();
            let listing = judged.list.unwrap_or(Listing::Tools);
            let item = item_listed(listing);
            // A service's own listing: its tools annotated, and filtered for the caller. A
            // virtual server's (toolgate-xds's, annotated already): filtered, each name looked
            // up in its routes; a name it does not route is not listed.
            let edit = |name: &str| match (server, service) {
                (Some(server), _) => {
                    let Some((service, own)) = routes.and_then(|r| routed(r, listing, name)) else {
                        return Edit::Hide;
                    };
                    match auth {
                        Some(a)
                            if !self.may_list(a, item, &service, &own, Some((server, name))) =>
                        {
                            Edit::Hide
                        }
                        _ => Edit::Keep,
                    }
                }
                (None, Some(service)) => match auth {
                    Some(a) if !self.may_list(a, item, service, name, None) => Edit::Hide,
                    _ if listing == Listing::Tools => shared
                        .availability(service, name, now)
                        .map_or(Edit::Keep, Edit::Annotate),
                    _ => Edit::Keep,
                },
                (None, None) => Edit::Keep,
            };
            let listed = if sse {
                match edit_sse(listing, &body, &judged.id, edit, end_of_stream) {
                    SseListed::Incomplete => return Action::Pause,
                    SseListed::Ended => Listed::NotTheResponse,
                    SseListed::Found(listed) => listed,
                }
            } else {
                edit_message(listing, &body, &judged.id, edit)
            };
            (listed, self.listing_filtered())
        };
        self.watch = Watch::None;
        match listed {
            Listed::Annotated {
                body: annotated,
                annotated: n,
                ..
            } => {
                if !sse {
                    host.set_response_header("content-length", Some(&annotated.len().to_string()));
                }
                host.set_response_body(body_size, &annotated);
                if n > 0 {
                    self.shared.borrow_mut().stats.count(TOOLS_LIST_ANNOTATED);
                }
            }
            Listed::Unchanged => {}
            Listed::Unread | Listed::NotTheResponse => {
                self.shared.borrow_mut().stats.count(TOOLS_LIST_UNREAD);
                // A listing that must be filtered for this caller but cannot be read is not
                // shown: names of tools the caller may not use are not disclosed.
                if filtered && !sse {
                    return self.unfilterable_listing(host, body_size);
                }
                if filtered {
                    // The stream's headers were held for this: it is replaced whole.
                    let reply = self.unfilterable_reply();
                    replacing(host, "200", reply.content_type);
                    if end_of_stream {
                        host.set_response_body(body_size, &reply.body);
                        return Action::Continue;
                    }
                    self.watch = Watch::Replace(reply);
                    return Action::Pause;
                }
            }
        }
        Action::Continue
    }

    /// Replaces a listing that could not be filtered with a JSON-RPC error (its headers are
    /// still held).
    pub(super) fn unfilterable_listing(
        &mut self,
        host: &impl CallHost,
        body_size: usize,
    ) -> Action {
        let reply = self.unfilterable_reply();
        host.set_response_header("content-type", Some(reply.content_type));
        host.set_response_header("content-length", Some(&reply.body.len().to_string()));
        host.set_response_header("content-encoding", None);
        host.set_response_body(body_size, &reply.body);
        Action::Continue
    }

    /// The error a listing that could not be filtered for its caller is replaced with.
    pub(super) fn unfilterable_reply(&self) -> Reply {
        reply::error(
            self.version,
            self.judged().map(|j| &j.id),
            reply::INTERNAL_ERROR,
            "The gateway could not read this tools/list answer to show only the tools you may call, so it is not shown; ask for the next page, or ask an operator.",
            None::<()>,
            Framing::Json,
        )
    }

    /// A GET stream Envoy could not open (no healthy instance, connect failure, full pool):
    /// 503 with `Retry-After` and a JSON-RPC error naming the service. A server's own answer
    /// passes as it is.
    pub(super) fn stream_response<H: CallHost>(
        &mut self,
        host: &H,
        head: &AnswerHead<'_, H>,
        end_of_stream: bool,
    ) -> Action {
        let status = head.status();
        if status < 500 {
            return Action::Continue;
        }
        let details = self.code_details(host);
        let overloaded = host.response_header("x-envoy-overloaded").is_some();
        let what = match verdict(status, overloaded, &details) {
            Verdict::Overloaded => UpstreamFailure::NoHealthyUpstream,
            Verdict::Failed(UpstreamFailure::Http5xx(_)) => return Action::Continue,
            Verdict::Failed(what) => what,
            _ => return Action::Continue,
        };
        let Some(service) = &self.service else {
            return Action::Continue;
        };
        let reply = reply::stream_unavailable(self.version, service, what);
        self.unavailable(host, reply, end_of_stream)
    }

    /// 503 with `Retry-After` and `reply` (a JSON-RPC error) in place of the response.
    pub(super) fn unavailable(
        &mut self,
        host: &impl CallHost,
        reply: Reply,
        end_of_stream: bool,
    ) -> Action {
        if end_of_stream {
            return self.send_local(
                host,
                503,
                &reply,
                &[("retry-after", STREAM_RETRY_AFTER_SECS)],
            );
        }
        replacing(host, "503", reply.content_type);
        host.set_response_header("retry-after", Some(STREAM_RETRY_AFTER_SECS));
        self.watch = Watch::Replace(reply);
        Action::Continue
    }
}
