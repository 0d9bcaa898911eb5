//! An answer's way back: its headers decide what to watch (a held JSON answer, an SSE stream
//! scanned for the response, a listing to annotate, a failure to replace), its body is
//! edited and judged as it passes, and the outcome is recorded when the stream ends.

use std::cell::OnceCell;

use super::*;

/// The answer's headers the filter reads, each asked of the host at most once: several parts
/// read the same ones, and a host call costs about a microsecond.
pub(super) struct AnswerHead<'h, H> {
    host: &'h H,
    status: OnceCell<u16>,
    content_type: OnceCell<String>,
}

impl<'h, H: CallHost> AnswerHead<'h, H> {
    pub(super) fn new(host: &'h H) -> Self {
        AnswerHead {
            host,
            status: OnceCell::new(),
            content_type: OnceCell::new(),
        }
    }

    /// The status, 0 when it is not a number.
    pub(super) fn status(&self) -> u16 {
        *self.status.get_or_init(|| {
            self.host
                .response_header(":status")
                .and_then(|s| s.parse::<u16>().ok())
                .unwrap_or(0)
        })
    }

    pub(super) fn success(&self) -> bool {
        (200..300).contains(&self.status())
    }

    pub(super) fn content_type(&self) -> &str {
        self.content_type.get_or_init(|| {
            self.host
                .response_header("content-type")
                .unwrap_or_default()
        })
    }

    pub(super) fn is_sse(&self) -> bool {
        self.content_type().starts_with("text/event-stream")
    }
}

impl<S: SharedStore, M: MetricHost> Call<S, M> {
    pub fn on_response_headers(&mut self, host: &impl CallHost, end_of_stream: bool) -> Action {
        if matches!(self.life, Life::Ignored) {
            // Not a request the filter read: nothing of its answer is either.
            return Action::Continue;
        }
        let head = AnswerHead::new(host);
        if self.sealing {
            self.seal_session(host);
        }
        if self.on_virtual.as_ref().is_some_and(|v| v.routed) {
            // The agent's session is the gateway's: a server's session id (with the instance's
            // address wrapped around it by the session affinity) must not replace it.
            host.set_response_header(SESSION_HEADER, None);
        }
        if let Some(action) = self.replay_lost_session(host, &head, end_of_stream) {
            return action;
        }
        if self.on_virtual.as_ref().is_some_and(|v| !v.routed) {
            if let Some(action) = self.control_plane_unreachable(host, &head, end_of_stream) {
                return action;
            }
        }
        // The filter asks servers for uncompressed answers; one compressed anyway cannot be
        // read, so it is neither judged nor edited: it passes as its headers say it is.
        let encoded = host
            .response_header("content-encoding")
            .is_some_and(|e| !e.trim().eq_ignore_ascii_case("identity"));
        if !encoded
            && self.held.as_ref().is_some_and(|h| {
                h.phase == HeldPhase::Sent && matches!(h.client, HeldFor::Stateless { .. })
            })
            && head.success()
        {
            if let Some(exchange) = self.exchange_mut() {
                exchange.completing = true;
                // The completed answer is longer.
                host.set_response_header("content-length", None);
            }
        }
        if matches!(self.life, Life::Stream) {
            return self.stream_response(host, &head, end_of_stream);
        }
        self.plan_edit(host, &head, encoded, end_of_stream);
        if self.judged().is_none() {
            return Action::Continue;
        }
        let status = head.status();
        // Each host call costs about a microsecond: only a failure needs Envoy's details.
        let (overloaded, details) = if status < 500 {
            (false, String::new())
        } else {
            (
                host.response_header("x-envoy-overloaded").is_some(),
                self.code_details(host),
            )
        };
        let v = verdict(status, overloaded, &details);
        if Kind::of_verdict(v).is_some() {
            self.read_endpoint(host);
        }
        if let Some(surface) = self.exchange_mut().and_then(|e| e.surface.take()) {
            self.surface_outcome(host, Kind::of_verdict(v));
            if let Some((own, visible)) = surface.rewritten_uri {
                if status == 200 && !encoded && !end_of_stream {
                    // The rewritten answer is longer.
                    host.set_response_header("content-length", None);
                    self.watch = Watch::ResourceUri { own, visible };
                    return Action::Pause;
                }
            }
        }
        match v {
            Verdict::Answered if encoded => self.unread_answer(host, end_of_stream),
            Verdict::Answered => {
                if self.admitted().is_none() {
                    let listing = self.judged().is_some_and(|j| j.list.is_some());
                    if listing && status == 200 && !end_of_stream {
                        return self.watch_listing(host, &head);
                    }
                    if let Some(scanner) = self.question_scanner(&head) {
                        self.watch = Watch::Questions(scanner);
                    }
                    return Action::Continue;
                }
                if end_of_stream {
                    // A success status and no body: no response to this request will come.
                    let reply = self.upstream_failed(host, UpstreamFailure::BadResponse);
                    return self.replace_now(host, reply);
                }
                if head.is_sse() {
                    if let Some(judged) = self.judged() {
                        let scanner = match self.question_scanner(&head) {
                            Some(noting) => noting,
                            None => SseScanner::new(judged.id.clone()),
                        };
                        self.watch = Watch::Sse(scanner);
                    }
                    // The stream may end without the response, and then gets one more event:
                    // a declared length would cut it off. Streams rarely declare one, and the
                    // header map is read already: a removal is a host call only when needed.
                    if host.response_header("content-length").is_some() {
                        host.set_response_header("content-length", None);
                    }
                    return Action::Continue;
                }
                let declared = host
                    .response_header("content-length")
                    .and_then(|v| v.trim().parse::<usize>().ok());
                if declared.is_some_and(|n| n > HOLD_LIMIT) {
                    self.watch = Watch::Json(Vec::new());
                    return Action::Continue;
                }
                self.watch = Watch::Hold;
                // Should the upstream reset now, Envoy's own reply must still be MCP: the mark
                // is that reply (JSON text: no line breaks, nothing a header cannot hold).
                let cut = self.cut_reply();
                if let Ok(cut) = std::str::from_utf8(&cut) {
                    host.set_request_header(HELD_HEADER, Some(cut));
                }
                Action::Pause
            }
            Verdict::ClientError => {
                // The request was at fault (an unknown session, a header the server refused).
                self.record(host, Outcome::Ignored, Some(Kind::Ok));
                Action::Continue
            }
            Verdict::Overloaded | Verdict::Failed(_) => {
                let what = match v {
                    Verdict::Failed(what) => Some(what),
                    _ => None,
                };
                let reply = match (self.admitted(), what) {
                    (Some(_), Some(what)) => self.upstream_failed(host, what),
                    (Some(_), None) => self.overloaded(host),
                    (None, what) => {
                        let (Some(judged), Some(service)) = (self.judged(), &self.service) else {
                            return Action::Continue;
                        };
                        let reply = reply::service_unavailable(
                            self.version,
                            &judged.id,
                            service,
                            what.unwrap_or(UpstreamFailure::NoHealthyUpstream),
                            self.framing,
                        );
                        if judged.discover {
                            return self.unavailable(host, reply, end_of_stream);
                        }
                        reply
                    }
                };
                if end_of_stream {
                    return self.replace_now(host, reply);
                }
                replacing(host, "200", reply.content_type);
                self.watch = Watch::Replace(reply);
                Action::Continue
            }
        }
    }

    /// Replaces a response that has no body to replace: a local reply in its place.
    pub(super) fn replace_now(&mut self, host: &impl CallHost, reply: Reply) -> Action {
        self.send_local(host, 200, &reply, &[])
    }

    pub fn on_response_body(
        &mut self,
        host: &impl CallHost,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        // A body callback that continued would release the held headers (the server's 404)
        // before the replayed answer is there.
        match self.held.as_ref().map(|h| h.phase) {
            Some(HeldPhase::Replaying) => return Action::Pause,
            Some(HeldPhase::Checking) => {
                return self.check_lost_session(host, body_size, end_of_stream)
            }
            _ => {}
        }
        let mut body_size = body_size;
        if let Some(exchange) = self.exchange_mut().filter(|e| e.completing) {
            if !end_of_stream {
                if body_size <= held_session::MAX_COMPLETED_BYTES {
                    return Action::Pause;
                }
                // Too large to hold: it goes as the server sent it.
                exchange.completing = false;
            } else {
                exchange.completing = false;
                let body = host.response_body(body_size).unwrap_or_default();
                if let Some(completed) = held_session::complete_results(&body) {
                    host.set_response_body(body_size, &completed);
                    body_size = completed.len();
                }
            }
        }
        // The body at hand, once read: read once however many parts look at it.
        let mut read: Option<Vec<u8>> = None;
        if self.edits_answer() {
            match self.edit_answer(host, body_size, end_of_stream) {
                Some(body) => {
                    body_size = body.len();
                    read = Some(body);
                }
                None => return Action::Pause,
            }
        }
        let mut body_at_hand = || {
            read.take()
                .unwrap_or_else(|| host.response_body(body_size).unwrap_or_default())
        };
        match &mut self.watch {
            Watch::None => Action::Continue,
            Watch::Listing { sse } => {
                let sse = *sse;
                self.listing_body(host, sse, body_size, end_of_stream)
            }
            Watch::ResourceUri { .. } => {
                if !end_of_stream {
                    if body_size > HOLD_LIMIT {
                        // Too large to hold: it goes as the server wrote it.
                        self.watch = Watch::None;
                        return Action::Continue;
                    }
                    return Action::Pause;
                }
                if let Watch::ResourceUri { own, visible } =
                    std::mem::replace(&mut self.watch, Watch::None)
                {
                    let body = body_at_hand();
                    if let Some(edited) = resource_uri::rewrite(&body, &own, &visible) {
                        host.set_response_body(body_size, &edited);
                    }
                }
                Action::Continue
            }
            Watch::Replace(_) => {
                if !end_of_stream {
                    return Action::Pause;
                }
                if let Watch::Replace(reply) = std::mem::replace(&mut self.watch, Watch::None) {
                    host.set_response_body(body_size, &reply.body);
                }
                Action::Continue
            }
            Watch::Hold => {
                if !end_of_stream {
                    if body_size > HOLD_LIMIT {
                        // Too large to hold: let it stream, judged from a copy.
                        let seen = body_at_hand();
                        self.watch = Watch::Json(seen);
                        return Action::Continue;
                    }
                    return Action::Pause;
                }
                self.watch = Watch::None;
                let body = body_at_hand();
                let Some(judged) = self.judged() else {
                    return Action::Continue;
                };
                let class = classify_response(&body, &judged.id);
                if let Some(what) = self.classified(host, class) {
                    let reply = self.failure_reply(what, self.framing);
                    host.set_response_header(":status", Some("200"));
                    host.set_response_header("content-type", Some(reply.content_type));
                    host.set_response_header("content-length", Some(&reply.body.len().to_string()));
                    host.set_response_body(body_size, &reply.body);
                }
                Action::Continue
            }
            Watch::Json(_) => {
                // Passed through as it streams; only this call's copy is kept.
                let chunk = body_at_hand();
                let Watch::Json(seen) = &mut self.watch else {
                    return Action::Continue;
                };
                if seen.len() + chunk.len() > MAX_JSON_RESPONSE {
                    self.watch = Watch::None;
                    self.record(host, Outcome::Ignored, Some(Kind::Ok));
                    return Action::Continue;
                }
                seen.extend_from_slice(&chunk);
                if !end_of_stream {
                    return Action::Continue;
                }
                let body = std::mem::take(seen);
                self.watch = Watch::None;
                if let Some(judged) = self.judged() {
                    let class = classify_response(&body, &judged.id);
                    // Too late to replace what already streamed; the failure still counts.
                    let _ = self.classified(host, class);
                }
                Action::Continue
            }
            Watch::Questions(scanner) => {
                let chunk = body_at_hand();
                let answered = scanner.feed(&chunk).is_some();
                let asked = scanner.take_requests();
                if answered || end_of_stream {
                    self.watch = Watch::None;
                }
                self.note_questions(host, asked);
                Action::Continue
            }
            Watch::Sse(scanner) => {
                // Streamed through: only the chunk at hand is read, never the whole stream.
                let chunk = body_at_hand();
                let found = match scanner.feed(&chunk) {
                    Some(class) => Some(class),
                    None if end_of_stream => scanner.finish(),
                    None => None,
                };
                let asked = scanner.take_requests();
                self.note_questions(host, asked);
                let Some(class) = found else {
                    return Action::Continue;
                };
                self.watch = Watch::None;
                let ended_early = end_of_stream && class == ResponseClass::Other;
                let what = if ended_early {
                    self.record(host, Outcome::Failure, Some(Kind::Reset));
                    Some(UpstreamFailure::NoResponse)
                } else {
                    self.classified(host, class)
                };
                if let Some(what) = what {
                    // The stream is the agent's: the reply goes at its end as one more event.
                    // A blank line and an event of a type MCP clients ignore first close
                    // whatever half-sent event the stream ended in.
                    let reply = self.failure_reply(what, Framing::Sse);
                    let mut body = chunk;
                    body.extend_from_slice(b"\nevent: toolgate-discarded\n\n");
                    body.extend_from_slice(&reply.body);
                    if end_of_stream {
                        host.set_response_body(body_size, &body);
                    }
                }
                Action::Continue
            }
        }
    }

    /// The stream ended. An admitted call whose outcome is still open ended without its
    /// response: the upstream went away mid-answer, or the client did. Only the first is the
    /// tool's fault.
    pub fn on_log(&mut self, host: &impl CallHost) {
        if self.admitted().is_none() {
            return;
        }
        let details = self.code_details(host);
        if upstream_ended(&details) {
            self.read_endpoint(host);
            self.record(host, Outcome::Failure, Some(Kind::Reset));
        } else {
            // The client cancelled, reset or broke the stream: no evidence about the tool, nor
            // about the instance.
            self.record(host, Outcome::Ignored, None);
        }
    }
}
