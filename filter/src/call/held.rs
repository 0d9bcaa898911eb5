//! Sessions toolgate-xds holds with servers for clients (of `/mcp`, of a stateless 2026-07-28
//! client, or sealed on a service's route): asked for once per Envoy, replayed when a server
//! lost one, and what the client is told when none can be had.

use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum HeldPhase {
    /// Asking toolgate-xds for the session; the request waits.
    Opening,
    /// The call went with the session.
    Sent,
    /// The server answered 400: its body is read to see whether it means "session unknown"
    /// (the TypeScript SDK's servers' -32000).
    Checking,
    /// The server no longer knew it: toolgate-xds decides, and replays the call on a new one
    /// if it was lost with its instance.
    Replaying,
}

/// Whose session a held one is.
pub(super) enum HeldFor {
    /// A client of the aggregate endpoint, by its gateway session id.
    Gateway { session_id: String },
    /// A client of a service's route, by the `initialize` parameters (their JSON) sealed in
    /// its id: a replayed answer carries its new id, sealed likewise.
    Route { init_params: String },
    /// A 2026-07-28 client of the aggregate endpoint, by the `initialize` parameters (their
    /// JSON) made of the identity its request states (it has no id to carry a new session's).
    Stateless { init_params: String },
}

impl HeldFor {
    pub(super) fn question(&self) -> held_session::Client<'_> {
        match self {
            HeldFor::Gateway { session_id } => held_session::Client::Gateway(session_id),
            HeldFor::Route { init_params } | HeldFor::Stateless { init_params } => {
                held_session::Client::Params(init_params)
            }
        }
    }
}

/// A call whose client's session the gateway holds or may re-open: on the aggregate endpoint
/// (a gateway session), or on a service's route (an id sealed with the client's parameters).
pub(super) struct HeldCall {
    pub(super) owner: String,
    pub(super) service: String,
    pub(super) client: HeldFor,
    pub(super) slot: String,
    /// The session envelope the call went with.
    pub(super) envelope: Option<String>,
    /// The call as the service got it, for a replay.
    pub(super) body: Vec<u8>,
    pub(super) phase: HeldPhase,
    /// An answer asked for long ago, used should asking again fail.
    pub(super) fallback: Option<held_session::Held>,
    /// When the session the call went with was opened, if known.
    pub(super) opened_ms: Option<u64>,
    /// Sent without a session: no toolgate-xds answered and none was held (see
    /// [`CallFilter::go_unsessioned`]).
    pub(super) unsessioned: bool,
}

impl HeldCall {
    /// The question to toolgate-xds about this session, counted for `caller`.
    pub(super) fn question<'a>(&'a self, caller: &'a str) -> held_session::Question<'a> {
        held_session::Question {
            owner: &self.owner,
            service: &self.service,
            client: self.client.question(),
            caller,
        }
    }

    /// Remembers for every worker that the client or its live server ended the session: it
    /// is neither used nor opened again. A stateless client has no session to end, only the
    /// one held for its identity: the next call opens another.
    pub(super) fn ended<S: SharedStore, M>(&self, shared: &Rc<RefCell<Shared<S, M>>>) {
        let value = match self.client {
            HeldFor::Stateless { .. } => Vec::new(),
            _ => held_session::encode_ended(&self.owner, &self.service),
        };
        let shared = shared.borrow();
        let store = shared.breakers.store();
        let cas = store.get(&self.slot).ok().flatten().map(|(_, cas)| cas);
        let _ = store.set(&self.slot, &value, cas);
    }

    /// Puts the held session on the request.
    pub(super) fn use_answer(&mut self, host: &impl CallHost, answer: &held_session::Held) {
        if let Some(envelope) = &answer.envelope {
            host.set_request_header(SESSION_HEADER, Some(envelope));
        }
        if !answer.protocol_version.is_empty() {
            host.set_request_header("mcp-protocol-version", Some(&answer.protocol_version));
        }
        self.envelope = answer.envelope.clone();
        self.opened_ms = answer.opened_ms;
    }

    /// Keeps the answer for every worker of this Envoy.
    pub(super) fn store<S: SharedStore, M>(
        &self,
        shared: &Rc<RefCell<Shared<S, M>>>,
        answer: &held_session::Held,
        now_ms: u64,
    ) {
        let value = held_session::encode_slot(&self.owner, &self.service, answer, now_ms);
        let shared = shared.borrow();
        let store = shared.breakers.store();
        // Last writer wins: a lost race leaves the other worker's answer, as good as this one.
        let cas = store.get(&self.slot).ok().flatten().map(|(_, cas)| cas);
        let _ = store.set(&self.slot, &value, cas);
    }
}

impl<S: SharedStore, M: MetricHost> Call<S, M> {
    /// Restores the session id the agent sent from its sealed form (see [`crate::session`]),
    /// before Envoy's session affinity reads it. An id sealed with the client's `initialize`
    /// parameters may have been re-opened on another instance (its own was gone): the
    /// session it goes with now is in shared data (see [`crate::held_session`]).
    pub(super) fn open_session(&mut self, host: &impl CallHost, service: &str) {
        let opened = {
            let shared = self.shared.borrow();
            let Some(sealer) = &shared.sealer else {
                return;
            };
            self.sealing = true;
            let Some(sent) = host.request_header(SESSION_HEADER) else {
                return;
            };
            match sealer.open(&sent, service) {
                Some(value) => Some((sent, value)),
                None => {
                    host.set_request_header(SESSION_HEADER, Some(&session::unusable(&sent)));
                    None
                }
            }
        };
        let Some((sent, value)) = opened else {
            return;
        };
        let (envelope, params, opened_ms) = held_session::split(&value);
        let identity = self.held_identity();
        let held = params.and_then(|p| {
            let owner = held_session::bound_to(
                held_session::owner_of(held_session::OwnerKind::Route, &sent)?,
                identity.as_deref(),
            );
            let slot = held_session::slot_key(&owner, service);
            Some(HeldCall {
                owner,
                service: service.to_string(),
                client: HeldFor::Route {
                    init_params: p.to_string(),
                },
                slot,
                envelope: Some(envelope.to_string()),
                body: Vec::new(),
                phase: HeldPhase::Sent,
                fallback: None,
                opened_ms,
                unsessioned: false,
            })
        });
        let Some(mut held) = held else {
            host.set_request_header(SESSION_HEADER, Some(envelope));
            return;
        };
        let slot = {
            let shared = self.shared.borrow();
            shared
                .breakers
                .store()
                .get(&held.slot)
                .ok()
                .flatten()
                .and_then(|(bytes, _)| held_session::decode_slot(&bytes, &held.owner, service))
        };
        match slot {
            Some(held_session::Slot::Held { held: answer, .. }) if answer.envelope.is_some() => {
                held.use_answer(host, &answer)
            }
            Some(held_session::Slot::Ended) => {
                // Ended by the client or its server: the server says so again (its "session
                // unknown" reaches the client), and nothing is re-opened.
                host.set_request_header(SESSION_HEADER, Some(&session::unusable(&sent)));
                return;
            }
            _ => host.set_request_header(SESSION_HEADER, Some(envelope)),
        }
        self.held = Some(held);
    }

    /// The digest of the verified user a held session is bound to, when the caller presented
    /// a valid token (see [`held_session::identity_tag`]).
    pub(super) fn held_identity(&self) -> Option<String> {
        let verified = self.auth.verified.as_ref()?;
        let issuer = verified
            .payload
            .get("iss")
            .and_then(|i| i.as_str())
            .unwrap_or_default();
        Some(held_session::identity_tag(issuer, &verified.caller.subject))
    }

    /// Whom toolgate-xds counts this client's held sessions for under its bounds.
    pub(super) fn held_caller(&self, host: &impl CallHost) -> String {
        let identity = self.held_identity();
        let source = match identity {
            Some(_) => None,
            None => host
                .property(&["source", "address"])
                .and_then(|a| String::from_utf8(a).ok()),
        };
        held_session::caller_key(identity.as_deref(), source.as_deref())
    }

    /// The verified claims this request carries to `service` as headers (its `claim_headers`),
    /// which a replay of it keeps.
    pub(super) fn held_claims(&self, service: &str) -> Vec<(String, String)> {
        let shared = self.shared.borrow();
        let (Some(rules), Some(verified)) = (
            shared
                .config
                .auth
                .as_ref()
                .and_then(|a| a.services.get(service)),
            &self.auth.verified,
        ) else {
            return Vec::new();
        };
        rules
            .claim_headers
            .iter()
            .filter_map(|(claim, header)| {
                let value = verified
                    .payload
                    .get(claim)
                    .and_then(auth::claim_header_value)?;
                Some((header.clone(), value))
            })
            .collect()
    }

    /// The `initialize` parameters of this client: those of the `initialize` it is sending,
    /// or those sealed in its id.
    pub(super) fn client_params(&self) -> Option<&str> {
        self.init_params.as_deref().or(match &self.held {
            Some(HeldCall {
                client: HeldFor::Route { init_params: p },
                ..
            }) => Some(p.as_str()),
            _ => None,
        })
    }

    /// Seals the session id of a response, which Envoy's session affinity has just wrapped
    /// around the upstream's address, with the client's parameters when known.
    pub(super) fn seal_session(&mut self, host: &impl CallHost) {
        let Some(value) = host.response_header(SESSION_HEADER) else {
            return;
        };
        // The time a session is opened goes with it (an initialize now, or the one it had).
        let opened_ms = if self.init_params.is_some() {
            Some(host.now_ms())
        } else {
            self.held.as_ref().and_then(|h| h.opened_ms)
        };
        let value = held_session::join(&value, self.client_params(), opened_ms);
        let service = self.service.as_deref().unwrap_or_default();
        let sealed = match &self.shared.borrow().sealer {
            Some(sealer) => sealer.seal(&value, service),
            None => return,
        };
        // A value too long to seal is dropped rather than passed with an address in it.
        host.set_response_header(SESSION_HEADER, sealed.as_deref());
    }

    /// The session this client's call would go on ended (the client or its live server ended
    /// it, or its gateway session is over): answered here as the server would, "session not
    /// found", so the client initializes again.
    pub(super) fn session_ended_here(&mut self, host: &impl CallHost) -> Action {
        self.record(host, Outcome::Ignored, None);
        let id = self.judged().map(|j| j.id.clone());
        let reply = reply::error(
            self.version,
            id.as_ref(),
            crate::mcp::request::INVALID_REQUEST,
            "Session not found: it was ended; initialize a new session",
            None::<()>,
            Framing::Json,
        );
        self.reply_locally(host, 404, &reply)
    }

    /// No session could be had for the call: it is answered here, saying what happened, and
    /// counts for nothing against the tool (the service's instances are judged by their
    /// probes). A replayed call that failed on its server counts as the failure it is.
    pub(super) fn session_unopened(
        &mut self,
        host: &impl CallHost,
        why: held_session::Unopened,
    ) -> Action {
        use held_session::Unopened as U;
        let failure = match why {
            U::NoInstance => UpstreamFailure::NoHealthyUpstream,
            U::AtBound { limit, per_caller } => UpstreamFailure::SessionLimit { limit, per_caller },
            U::Refused(status) => UpstreamFailure::SessionRefused(status),
            U::Timeout | U::CallTimeout => UpstreamFailure::Timeout,
            U::CallReset => UpstreamFailure::Reset,
            U::CallBadResponse => UpstreamFailure::BadResponse,
            U::Unreachable | U::Failed => UpstreamFailure::ConnectFailure,
            U::Overloaded => {
                if self.admitted().is_some() {
                    let reply = self.overloaded(host);
                    return self.reply_locally(host, 200, &reply);
                }
                UpstreamFailure::NoHealthyUpstream
            }
            U::Ended | U::SessionGone => return self.session_ended_here(host),
        };
        match why {
            U::CallTimeout | U::CallReset | U::CallBadResponse => {
                self.record(host, Outcome::Failure, None)
            }
            _ => self.record(host, Outcome::Ignored, None),
        }
        let (Some(judged), Some(service)) = (self.judged(), &self.service) else {
            return Action::Continue;
        };
        // An admitted `tools/call` gets the semantic reply, naming its fallback, as it does
        // when Envoy finds no healthy upstream: a client of the aggregate endpoint with a
        // gateway session got a JSON-RPC error instead once its tool's service had left
        // (tests/tests/aggregate_calls.rs).
        if judged.tool.is_some() {
            let reply = self.failure_reply(failure, self.framing);
            return self.reply_locally(host, 200, &reply);
        }
        let reply =
            reply::service_unavailable(self.version, &judged.id, service, failure, self.framing);
        self.reply_locally(host, 200, &reply)
    }

    /// toolgate-xds answered a question this call asked (a session opened, a call replayed).
    pub fn on_dispatch_response(
        &mut self,
        host: &impl CallHost,
        callout: u32,
        status: Option<u16>,
        body: &[u8],
    ) -> Action {
        if self.is_credential_answer(callout) {
            return self.on_credential(host, status, body);
        }
        let Some(held) = self.held.as_mut() else {
            return Action::Continue;
        };
        match held.phase {
            HeldPhase::Opening => {
                let answer = match status {
                    Some(200) => serde_json::from_slice::<held_session::Held>(body).ok(),
                    _ => None,
                };
                // An answer asked for a while ago is used still when toolgate-xds does not
                // answer, or could not open another; not when it said the session is over or
                // not to be had. Kept as asked now, so that calls do not all ask again.
                let kept = matches!(
                    held_session::unopened(status, body),
                    held_session::Unopened::Failed
                        | held_session::Unopened::Unreachable
                        | held_session::Unopened::Timeout
                        | held_session::Unopened::Refused(_)
                );
                let answer = match (answer, held.fallback.take()) {
                    (Some(a), _) => Some(a),
                    (None, Some(old)) if kept => {
                        held.store(&self.shared, &old, host.now_ms());
                        held.use_answer(host, &old);
                        held.phase = HeldPhase::Sent;
                        return self.go_on(host);
                    }
                    (None, None)
                        if held_session::unopened(status, body)
                            == held_session::Unopened::Failed =>
                    {
                        return self.go_unsessioned(host);
                    }
                    (None, _) => None,
                };
                let Some(answer) = answer else {
                    host.log(
                        Level::Warn,
                        &format!(
                            "toolgate: no session with service {} for a client of the aggregate endpoint: toolgate-xds answered {status:?}: {}",
                            held.service,
                            String::from_utf8_lossy(&body[..body.len().min(300)])
                        ),
                    );
                    // Answered locally: the paused request is not resumed.
                    let why = held_session::unopened(status, body);
                    return self.session_unopened(host, why);
                };
                held.store(&self.shared, &answer, host.now_ms());
                held.use_answer(host, &answer);
                held.phase = HeldPhase::Sent;
                self.go_on(host)
            }
            HeldPhase::Replaying => {
                let replayed = match status {
                    Some(200) => serde_json::from_slice::<held_session::Replayed>(body).ok(),
                    _ => None,
                };
                held.phase = HeldPhase::Sent;
                let Some(r) = replayed else {
                    return self.replay_refused(host, status, body);
                };
                held.store(&self.shared, &r.held, host.now_ms());
                held.opened_ms = r.held.opened_ms;
                // A client of a service's route gets its new id (those SDKs that take a new id
                // from any response do; the others keep the old one, which now leads here too).
                let resealed = match (&held.client, &r.held.envelope) {
                    (
                        HeldFor::Route {
                            init_params: params,
                        },
                        Some(envelope),
                    ) => {
                        let value = held_session::join(envelope, Some(params), r.held.opened_ms);
                        self.shared
                            .borrow()
                            .sealer
                            .as_ref()
                            .and_then(|s| s.seal(&value, &held.service))
                    }
                    _ => None,
                };
                let stateless = matches!(held.client, HeldFor::Stateless { .. });
                if let Some(what) = self.replayed_outcome(host, &r) {
                    // Not an answer the client could use: the failure, in MCP terms.
                    let reply = self.failure_reply(what, self.framing);
                    self.send_local(host, 200, &reply, &[]);
                    return Action::Continue;
                }
                let headers: Vec<(&str, &str)> = resealed
                    .as_deref()
                    .map(|id| vec![(SESSION_HEADER, id)])
                    .unwrap_or_default();
                let completed = if stateless && (200..300).contains(&r.status) {
                    held_session::complete_results(r.body.as_bytes())
                } else {
                    None
                };
                self.enter(Life::Answered);
                host.send_raw(
                    u32::from(r.status),
                    &r.content_type,
                    completed.as_deref().unwrap_or(r.body.as_bytes()),
                    &headers,
                );
                Action::Continue
            }
            HeldPhase::Sent | HeldPhase::Checking => Action::Continue,
        }
    }

    /// No toolgate-xds answered and no session with the service is held for this client: the
    /// call goes to the service without one. A server that needs none (stateless, or of a
    /// revision without sessions) answers it; one that needs a session says "session unknown",
    /// and the client gets a tool result saying so ([`CallFilter::unsessioned_refused`]).
    pub(super) fn go_unsessioned(&mut self, host: &impl CallHost) -> Action {
        self.mark_unsessioned();
        self.go_on(host)
    }

    pub(super) fn mark_unsessioned(&mut self) {
        if let Some(held) = self.held.as_mut() {
            held.unsessioned = true;
            held.phase = HeldPhase::Sent;
            held.envelope = None;
        }
        self.shared.borrow_mut().stats.count(UNSESSIONED_CALLS);
    }

    /// A call sent without a session ([`CallFilter::go_unsessioned`]) that the server refused
    /// for want of one: the failure, in MCP terms, in place of the server's answer.
    pub(super) fn unsessioned_refused(&mut self, host: &impl CallHost) -> Action {
        if let Some(h) = self.held.as_mut() {
            h.phase = HeldPhase::Sent;
            h.unsessioned = false;
        }
        // Not the tool's fault, nor the instance's.
        self.record(host, Outcome::Ignored, None);
        let failure = UpstreamFailure::NoControlPlane;
        let reply = match (self.judged(), &self.service) {
            (Some(judged), _) if judged.tool.is_some() => self.failure_reply(failure, self.framing),
            (Some(judged), Some(service)) => {
                reply::service_unavailable(self.version, &judged.id, service, failure, self.framing)
            }
            _ => return Action::Continue,
        };
        self.send_local(host, 200, &reply, &[])
    }

    /// A call on a held or sealed session that the server answered "session unknown"
    /// (`toolgate_model::session_loss`): toolgate-xds decides whether the session was lost
    /// with its instance (re-opened, and the call replayed there) or ended by the client or
    /// the live server (the server's answer goes on). A 404 says so at once; a 400 says so in
    /// its body, which is held and read first ([`HeldPhase::Checking`]).
    pub(super) fn replay_lost_session<H: CallHost>(
        &mut self,
        host: &H,
        head: &AnswerHead<'_, H>,
        end_of_stream: bool,
    ) -> Option<Action> {
        let held = self.held.as_mut()?;
        let unsessioned = held.unsessioned && held.phase == HeldPhase::Sent;
        if !unsessioned
            && (held.phase != HeldPhase::Sent || held.envelope.is_none() || held.body.is_empty())
        {
            return None;
        }
        let status = head.status();
        if toolgate_model::session_loss::session_unknown(status, None) {
            if unsessioned {
                return Some(self.unsessioned_refused(host));
            }
            return self.ask_replay(host);
        }
        if unsessioned && status == 400 && end_of_stream {
            return Some(self.unsessioned_refused(host));
        }
        // A 400 without a body cannot say -32000.
        if status == 400 && !end_of_stream {
            held.phase = HeldPhase::Checking;
            return Some(Action::Pause);
        }
        None
    }

    /// Asks toolgate-xds to replay the call whose session the server no longer knows; `None`
    /// when the question could not be sent (the server's answer goes on).
    pub(super) fn ask_replay(&mut self, host: &impl CallHost) -> Option<Action> {
        let caller = self.held_caller(host);
        let claims = self.held_claims(self.held.as_ref()?.service.as_str());
        let answered_by = host
            .property(&["upstream", "address"])
            .and_then(|a| String::from_utf8(a).ok());
        let held = self.held.as_mut()?;
        let stale = held.envelope.clone().unwrap_or_default();
        let lost = held_session::LostSession {
            stale: &stale,
            opened_ms: held.opened_ms,
            answered_by: answered_by.as_deref(),
        };
        let request =
            held_session::replay_request(&held.question(&caller), &lost, &held.body, &claims);
        held.phase = HeldPhase::Replaying;
        if host
            .dispatch(
                held_session::REPLAY_PATH,
                &request,
                &self.report_authorization(),
            )
            .is_some()
        {
            Some(Action::Pause)
        } else {
            if let Some(h) = self.held.as_mut() {
                h.phase = HeldPhase::Sent;
            }
            None
        }
    }

    /// toolgate-xds replayed nothing. Ended by the client or the live server: the server's
    /// answer goes on (the client initializes again, as the specification says it must), and
    /// the slot remembers. Otherwise the client is told what happened.
    pub(super) fn replay_refused(
        &mut self,
        host: &impl CallHost,
        status: Option<u16>,
        body: &[u8],
    ) -> Action {
        let why = held_session::unopened(status, body);
        match why {
            held_session::Unopened::Ended | held_session::Unopened::SessionGone => {
                if let Some(h) = &self.held {
                    h.ended(&self.shared);
                }
                // The request was not the tool's to fail.
                self.record(host, Outcome::Ignored, Some(Kind::Ok));
                host.resume_response();
                Action::Continue
            }
            // No answer from toolgate-xds: the server's goes on.
            held_session::Unopened::Failed => {
                self.record(host, Outcome::Ignored, None);
                host.resume_response();
                Action::Continue
            }
            // Told here what happened, when there is a request to answer; a notification's
            // answer is the server's.
            why if self.judged().is_some() && self.service.is_some() => {
                self.session_unopened(host, why);
                Action::Continue
            }
            _ => {
                self.record(host, Outcome::Ignored, None);
                host.resume_response();
                Action::Continue
            }
        }
    }

    /// Records what the server answered a replayed call, as any call's answer counts; the
    /// failure to answer in its place when it is not an answer the client can use.
    pub(super) fn replayed_outcome(
        &mut self,
        host: &impl CallHost,
        r: &held_session::Replayed,
    ) -> Option<UpstreamFailure> {
        // Only an admitted call has an outcome to record.
        self.admitted()?;
        let id = self.judged().map(|j| j.id.clone())?;
        match r.status {
            500..=599 => {
                self.record(host, Outcome::Failure, None);
                Some(UpstreamFailure::Http5xx(r.status))
            }
            200..=299 => {
                let class = if r.content_type.starts_with("text/event-stream") {
                    let mut scanner = SseScanner::new(id);
                    scanner
                        .feed(r.body.as_bytes())
                        .or_else(|| scanner.finish())
                        .unwrap_or(ResponseClass::Other)
                } else {
                    classify_response(r.body.as_bytes(), &id)
                };
                self.classified(host, class)
            }
            _ => {
                self.record(host, Outcome::Ignored, Some(Kind::Ok));
                None
            }
        }
    }

    /// A 400 the server answered a call on a held or sealed session: "session unknown" when its
    /// body says -32000 (the TypeScript SDK's servers), else the request's own fault.
    pub(super) fn check_lost_session(
        &mut self,
        host: &impl CallHost,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        let small = body_size <= toolgate_model::session_loss::MAX_ERROR_BODY;
        if !end_of_stream && small {
            return Action::Pause;
        }
        let unsessioned = self.held.as_ref().is_some_and(|h| h.unsessioned);
        let code = (end_of_stream && small)
            .then(|| {
                let body = host.response_body(body_size).unwrap_or_default();
                toolgate_model::session_loss::rpc_error_code(&body)
            })
            .flatten();
        let unknown =
            end_of_stream && small && toolgate_model::session_loss::session_unknown(400, code);
        // Sent without a session, a 400 that is not JSON-RPC is the server asking for one (rmcp
        // says "Session ID is required" in plain text): refused in MCP, never passed as text.
        if unsessioned && (unknown || code.is_none()) {
            return self.unsessioned_refused(host);
        }
        if unknown {
            if let Some(action) = self.ask_replay(host) {
                return action;
            }
        }
        if let Some(h) = self.held.as_mut() {
            h.phase = HeldPhase::Sent;
        }
        // The request was at fault (a header the server refused), as any 4xx.
        self.record(host, Outcome::Ignored, Some(Kind::Ok));
        Action::Continue
    }
}
