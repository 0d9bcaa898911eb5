//! Whether a request goes upstream: the breaker's verdict for a (service, tool), a forced
//! override, the bulkhead's trial slots, batches judged element by element, and what a
//! VM without a configuration answers.

use super::*;

/// The reply's words for why a breaker opened.
pub(super) fn open_cause(cause: Option<&Cause>) -> OpenCause {
    match cause {
        Some(Cause::FailureRate {
            percent,
            calls,
            window_secs,
        }) => OpenCause::FailureRate {
            percent: *percent,
            calls: *calls,
            window_secs: *window_secs,
        },
        Some(Cause::SlowCallRate {
            percent,
            calls,
            window_secs,
            slow_call_ms,
        }) => OpenCause::SlowCallRate {
            percent: *percent,
            calls: *calls,
            window_secs: *window_secs,
            slow_call_ms: *slow_call_ms,
        },
        Some(Cause::ProbeFailed) => OpenCause::ProbeFailed,
        Some(Cause::ProbeSlow) => OpenCause::ProbeSlow,
        Some(Cause::Fleet) => OpenCause::Fleet,
        _ => OpenCause::Unknown,
    }
}

/// The request this call carries, once judged.
pub(super) struct Judged {
    pub(super) id: RawId,
    /// A 2026-07-28 `server/discover`: the SDKs' version probe. Answered 503 when no server
    /// can take it, since the probe reads a JSON-RPC error at 200 as "this server predates
    /// 2026-07-28" (and a client pinned to it then blames the version, not the outage).
    pub(super) discover: bool,
    /// For an admitted `tools/call`: the tool, and the fallback its policy names.
    pub(super) tool: Option<(String, Option<String>)>,
    /// A listing whose answer the filter reads: a `tools/list` on a service's route (to
    /// annotate it), or any listing that must be filtered for the caller.
    pub(super) list: Option<Listing>,
}

/// What the judge decided about one `tools/call`.
pub(super) enum Judgement {
    /// Upstream without a breaker (a service the catalog does not know, an unlisted tool past
    /// the bound).
    Pass,
    Admit(Admitted),
    Refuse(Refused),
}

/// A call the gateway answers itself, owned so that it outlives the borrow of the shared
/// state it was decided under.
#[derive(Debug, Clone)]
pub(super) enum Refused {
    Plain(Refusal),
    /// A name the aggregate endpoint `endpoint` does not offer.
    NotOffered {
        endpoint: String,
        tool: String,
    },
    /// `/virtual/<name>` of a virtual server the configuration does not have.
    NoVirtualServer(String),
    /// A call in a batch the caller may not make (issue 20).
    NotPermitted {
        service: String,
        item: Item,
        name: String,
    },
    ForcedOpen {
        tool: String,
        reason: String,
        fallback: Option<String>,
    },
    Breaker {
        tool: String,
        state: State,
        cause: OpenCause,
        retry_after_secs: u64,
        fallback: Option<String>,
    },
    /// Over a call limit: `tool` for a `tools/call`, `None` for any other request.
    Limited {
        tool: Option<String>,
        over: OverLimit,
        fallback: Option<String>,
    },
}

impl Refused {
    /// The semantic details, for refusals that are a tool's unavailability.
    pub(super) fn unavailable(&self) -> Option<Unavailable<'_>> {
        match self {
            Refused::ForcedOpen {
                tool,
                reason,
                fallback,
            } => Some(Unavailable {
                kind: UnavailableKind::ForcedOpen { reason },
                tool: Some(tool),
                retry_after_secs: None,
                fallback_tool: fallback.as_deref(),
            }),
            Refused::Breaker {
                tool,
                state,
                cause,
                retry_after_secs,
                fallback,
            } => Some(Unavailable {
                kind: if *state == State::HalfOpen {
                    UnavailableKind::Probing
                } else {
                    UnavailableKind::Open { cause: *cause }
                },
                tool: Some(tool),
                retry_after_secs: Some(*retry_after_secs),
                fallback_tool: fallback.as_deref(),
            }),
            Refused::NotOffered { endpoint, tool } => Some(Unavailable {
                kind: UnavailableKind::NotOffered { endpoint },
                tool: Some(tool),
                retry_after_secs: None,
                fallback_tool: None,
            }),
            Refused::Limited {
                tool: Some(tool),
                over,
                fallback,
            } => Some(Unavailable {
                kind: UnavailableKind::Limited {
                    limit: over.limit(),
                },
                tool: Some(tool),
                retry_after_secs: Some(over.retry_after_secs),
                fallback_tool: fallback.as_deref(),
            }),
            Refused::Plain(_)
            | Refused::NoVirtualServer(_)
            | Refused::NotPermitted { .. }
            | Refused::Limited { tool: None, .. } => None,
        }
    }

    pub(super) fn reply(&self, version: ProtocolVersion, id: &RawId, framing: Framing) -> Reply {
        if let Some(details) = self.unavailable() {
            return reply::tool_unavailable(version, id, &details, framing);
        }
        match self {
            Refused::NoVirtualServer(name) => {
                reply::unknown_virtual_server(version, id, name, framing)
            }
            Refused::Plain(refusal) => reply::refused(version, Some(id), *refusal, framing),
            _ => reply::refused(version, Some(id), Refusal::NotAMessage, framing),
        }
    }

    /// The refusal as the agent on virtual server `server` must read it: tools by the names
    /// it sees there (`visible` for the one called), a fallback only if offered there.
    pub(super) fn seen_on(
        self,
        server: &str,
        visible: &str,
        service: &str,
        names: &VisibleNames,
    ) -> Self {
        let seen = |fallback: Option<String>| {
            fallback.and_then(|f| names.get(server, service, &f).map(str::to_string))
        };
        match self {
            Refused::ForcedOpen {
                reason, fallback, ..
            } => Refused::ForcedOpen {
                tool: visible.to_string(),
                reason,
                fallback: seen(fallback),
            },
            Refused::Breaker {
                state,
                cause,
                retry_after_secs,
                fallback,
                ..
            } => Refused::Breaker {
                tool: visible.to_string(),
                state,
                cause,
                retry_after_secs,
                fallback: seen(fallback),
            },
            Refused::Limited {
                tool: Some(_),
                over,
                fallback,
            } => Refused::Limited {
                tool: Some(visible.to_string()),
                over,
                fallback: seen(fallback),
            },
            other => other,
        }
    }

    /// The audit trail's decision and reason for this refusal.
    pub(super) fn decision(&self) -> (&'static str, &str) {
        match self {
            Refused::Limited { over, .. } => ("limited", &over.rule),
            Refused::NotPermitted { .. } => ("denied", "not_permitted"),
            Refused::ForcedOpen { .. } => ("refused", "forced_open"),
            Refused::Breaker {
                state: State::HalfOpen,
                ..
            } => ("refused", "half_open"),
            Refused::Breaker { .. } => ("refused", "open"),
            Refused::NotOffered { .. } => ("refused", "not_offered"),
            Refused::NoVirtualServer(_) => ("refused", "no_virtual_server"),
            Refused::Plain(_) => ("refused", "bad_request"),
        }
    }

    /// The JSON-RPC error of a refusal that is not an unavailability (for batches).
    pub(super) fn error(&self) -> (i64, String) {
        match self {
            Refused::NotOffered { endpoint, tool } => (
                crate::mcp::request::INVALID_PARAMS,
                reply::tool_not_offered_message(endpoint, tool),
            ),
            Refused::Plain(refusal) => (refusal.code(), refusal.to_string()),
            Refused::NotPermitted {
                service,
                item,
                name,
            } => (
                auth::NOT_AUTHORIZED,
                auth::not_permitted_message(*item, name, &format!("the MCP service `{service}`")),
            ),
            Refused::Limited { over, .. } => (
                LIMITED_CODE,
                format!(
                    "The request was not made: {} at this gateway. Do not retry it before {} \
                     seconds.",
                    over.limit().describe(),
                    over.retry_after_secs
                ),
            ),
            _ => (reply::INTERNAL_ERROR, String::new()),
        }
    }
}

/// The JSON-RPC error a VM without a configuration answers with (no id: it judged nothing).
fn unconfigured_reply(version: ProtocolVersion) -> Reply {
    reply::error(
        version,
        None,
        reply::INTERNAL_ERROR,
        &unconfigured_message(),
        None::<()>,
        Framing::Json,
    )
}

/// The words of every refusal made for want of a configuration.
pub(super) fn unconfigured_message() -> String {
    format!(
        "This MCP gateway cannot serve requests now: {}. Nothing was sent to a server; an \
         operator must look at the gateway.",
        reply::UNCONFIGURED
    )
}

impl<S: SharedStore, M: MetricHost> Call<S, M> {
    /// A request on an MCP path while this VM has no configuration it accepted: nothing can
    /// be judged (no overrides, rules, catalog or session key), so nothing goes upstream. A
    /// POST's body is read for its id; anything else is answered at once.
    pub(super) fn refuse_unconfigured(
        &mut self,
        host: &impl CallHost,
        end_of_stream: bool,
    ) -> Action {
        self.version =
            ProtocolVersion::from_header(host.request_header("mcp-protocol-version").as_deref());
        self.framing = Framing::from_accept(host.request_header("accept").as_deref());
        if is_post(host) && !end_of_stream {
            self.enter(Life::Unconfigured { body_len: 0 });
            return Action::Pause;
        }
        let reply = unconfigured_reply(self.version);
        self.send_local(
            host,
            503,
            &reply,
            &[("retry-after", STREAM_RETRY_AFTER_SECS)],
        )
    }

    /// The body of a POST refused for want of a configuration: answered with its id once
    /// complete (a `tools/call` with a tool result the model can act on).
    pub(super) fn unconfigured_body(
        &mut self,
        host: &impl CallHost,
        body_size: usize,
        end_of_stream: bool,
    ) -> Action {
        if let Life::Unconfigured { body_len } = &mut self.life {
            *body_len = body_size;
        }
        let limit = self.shared.borrow().config.max_body_bytes;
        if !end_of_stream && body_size as u64 <= limit {
            return Action::Pause;
        }
        let bytes = if body_size as u64 <= limit {
            host.request_body(body_size).unwrap_or_default()
        } else {
            Vec::new()
        };
        let request = match read_body(&bytes) {
            Ok(Body::Request(r)) => Some((r.id.clone(), r.method == TOOLS_CALL)),
            _ => None,
        };
        let reply = match &request {
            Some((id, true)) => {
                let details = Unavailable {
                    kind: UnavailableKind::Unconfigured,
                    tool: None,
                    retry_after_secs: None,
                    fallback_tool: None,
                };
                reply::tool_unavailable(self.version, id, &details, self.framing)
            }
            Some((id, false)) => reply::error(
                self.version,
                Some(id),
                reply::INTERNAL_ERROR,
                &unconfigured_message(),
                None::<()>,
                self.framing,
            ),
            None => unconfigured_reply(self.version),
        };
        self.reply_locally(host, 200, &reply)
    }

    pub(super) fn judge_request(
        &mut self,
        host: &impl CallHost,
        service: &str,
        request: Request<'_>,
    ) -> Action {
        let tool = match self.called_tool(host, &request) {
            Ok(Some(tool)) => tool,
            Ok(None) => {
                for (item, name) in surface_items(&request) {
                    if let Some(refused) =
                        self.authorize(host, item, service, &name, None, &request.id)
                    {
                        return refused;
                    }
                }
                if self.has_limits(service) {
                    if let Some(over) = self.over_limit(host, service, None) {
                        return self.refuse_over_limit(host, &request.id, &over);
                    }
                }
                return Action::Continue;
            }
            Err(answered) => return answered,
        };
        self.log_field(host, log_field::TOOL, tool);
        self.log_field(host, log_field::SERVICE, service);
        if let Some(refused) = self.authorize(host, Item::Tool, service, tool, None, &request.id) {
            return refused;
        }
        let judgement = self.verdict_on(host, service, tool);
        self.record_decision(host, &judgement);
        match judgement {
            Judgement::Refuse(refused) => {
                let reply = refused.reply(self.version, &request.id, self.framing);
                self.reply_locally(host, 200, &reply)
            }
            Judgement::Pass => Action::Continue,
            Judgement::Admit(admitted) => {
                let tool = (admitted.tool.clone(), admitted.policy.fallback_tool.clone());
                self.admit(admitted, tool);
                Action::Continue
            }
        }
    }

    /// Decides one `tools/call`: pass unjudged, refuse, or admit with a breaker.
    pub(super) fn verdict_on(
        &mut self,
        host: &impl CallHost,
        service: &str,
        tool: &str,
    ) -> Judgement {
        // A tool an operator forced open takes no token: the override answers first, below.
        if self.has_limits(service) && !self.forced_open(service, tool) {
            if let Some(over) = self.over_limit(host, service, Some(tool)) {
                let fallback = self
                    .shared
                    .borrow()
                    .config
                    .policy_for(service, tool)
                    .fallback_tool;
                return Judgement::Refuse(Refused::Limited {
                    tool: Some(tool.to_string()),
                    over,
                    fallback,
                });
            }
        }
        let now = host.now_ms();
        let mut guard = self.shared.borrow_mut();
        let Shared {
            config,
            breakers,
            stats,
            unlisted,
            ..
        } = &mut *guard;
        let key = breaker_key(service, tool);
        if let Some(reason) = fleet::forced_open(&config.overrides, service, tool) {
            let policy = config.policy_for(service, tool);
            let rejected = Admission::Reject {
                retry_after_ms: 0,
                state: State::Open,
                forced: true,
            };
            stats.admitted(&key, service, tool, &rejected, now);
            let refused = Refused::ForcedOpen {
                tool: tool.to_string(),
                reason: reason.to_string(),
                fallback: policy.fallback_tool,
            };
            drop(guard);
            self.log_field(host, log_field::BREAKER, "forced_open");
            return Judgement::Refuse(refused);
        }
        let mut learning = false;
        match catalog::lookup(&config.catalog, service, tool) {
            Known::Listed => {}
            // The server answers for a name the gateway holds no state for: no breaker, no
            // stats of its own (a request cannot create either by naming things).
            Known::NotListed => {
                stats.count(CALLS_UNLISTED);
                return Judgement::Pass;
            }
            Known::UnknownService => return Judgement::Pass,
            Known::Unlisted => {
                if !unlisted.admits(breakers.store(), service, tool, now) {
                    // Watched like an admitted call, without a breaker: if the server answers
                    // it as a tool, the name gets one.
                    learning = true;
                }
            }
        }
        let policy = config.policy_for(service, tool);
        if learning {
            drop(guard);
            return Judgement::Admit(Admitted {
                key,
                tool: tool.to_string(),
                policy,
                admission: Admission::Allow,
                started_ms: now,
                metrics: None,
                endpoint: Endpoint::Unread,
                learning: true,
            });
        }
        let (admission, transition) = breakers.admit(&key, &policy, now);
        let metrics = stats.admitted(&key, service, tool, &admission, now);
        if let Some(t) = &transition {
            stats.transition(&key, t.to, t.at_ms);
        }
        let opened_by = match admission {
            Admission::Reject { forced: false, .. } => {
                breakers.snapshot(&key).and_then(|b| b.opened_by().cloned())
            }
            _ => None,
        };
        drop(guard);
        if let Some(t) = transition {
            host.log(Level::Warn, &transition_line(&key, &t));
        }
        self.log_field(
            host,
            log_field::BREAKER,
            match &admission {
                Admission::Allow => "closed",
                Admission::Probe { .. } => "half_open",
                Admission::Reject { forced: true, .. } => "forced_open",
                Admission::Reject { .. } => "open",
            },
        );
        match admission {
            // A force the breaker still carries after its override was lifted: lifted on
            // the next configuration; until then it is an operator's, with no end to tell.
            Admission::Reject { forced: true, .. } => Judgement::Refuse(Refused::ForcedOpen {
                tool: tool.to_string(),
                reason: String::new(),
                fallback: policy.fallback_tool.clone(),
            }),
            Admission::Reject {
                retry_after_ms,
                state,
                forced: false,
            } => Judgement::Refuse(Refused::Breaker {
                tool: tool.to_string(),
                state,
                cause: open_cause(opened_by.as_ref()),
                retry_after_secs: retry_after_ms.div_ceil(1000).max(1),
                fallback: policy.fallback_tool.clone(),
            }),
            Admission::Allow | Admission::Probe { .. } => Judgement::Admit(Admitted {
                key,
                tool: tool.to_string(),
                policy,
                admission,
                started_ms: now,
                metrics,
                endpoint: Endpoint::Unread,
                learning: false,
            }),
        }
    }

    /// The audit trail's line for a judged `tools/call`: what was decided, and why.
    pub(super) fn record_decision(&self, host: &impl CallHost, judgement: &Judgement) {
        match judgement {
            Judgement::Refuse(refused) => {
                let (decision, reason) = refused.decision();
                self.log_field(host, log_field::DECISION, decision);
                self.log_field(host, log_field::REASON, reason);
            }
            Judgement::Pass | Judgement::Admit(_) => {
                self.log_field(host, log_field::DECISION, "allowed")
            }
        }
    }

    fn forced_open(&self, service: &str, tool: &str) -> bool {
        fleet::forced_open(&self.shared.borrow().config.overrides, service, tool).is_some()
    }

    /// A 2025-03-26 batch: every element is judged; if any call in it would be refused, none
    /// of it runs and every request gets an answer. Calls of an admitted batch go upstream
    /// without a breaker outcome (one response then carries several tools' results), and a
    /// half-open tool takes no batched call (its probes must be judged one by one).
    pub(super) fn judge_batch(
        &mut self,
        host: &impl CallHost,
        service: &str,
        elements: Vec<Body<'_>>,
    ) -> Action {
        if self.version > ProtocolVersion::V2025_03_26 {
            return self.refuse(host, 400, None, Refusal::BatchNotAllowed);
        }
        self.log_field(host, log_field::METHOD, "batch");
        let now = host.now_ms();
        let mut answers: Vec<(RawId, Option<Refused>)> = Vec::new();
        let mut any_refused = false;
        for element in &elements {
            let Body::Request(request) = element else {
                continue;
            };
            let mut refused = if request.method == TOOLS_CALL {
                self.peek_call(service, request, now)
            } else {
                self.peek_surface(service, request)
            };
            // Each request of a batch counts against the limits as if it came alone.
            if refused.is_none() && self.has_limits(service) {
                let tool = match request.tool() {
                    Some(ToolName::Valid(tool)) if request.method == TOOLS_CALL => Some(tool),
                    _ => None,
                };
                refused = self
                    .over_limit(host, service, tool)
                    .map(|over| Refused::Limited {
                        tool: tool.map(str::to_string),
                        over,
                        fallback: tool.and_then(|t| {
                            self.shared
                                .borrow()
                                .config
                                .policy_for(service, t)
                                .fallback_tool
                        }),
                    });
            }
            any_refused |= refused.is_some();
            answers.push((request.id.clone(), refused));
        }
        if !any_refused {
            return Action::Continue;
        }
        let details: Vec<Option<Unavailable<'_>>> = answers
            .iter()
            .map(|(_, r)| r.as_ref().and_then(Refused::unavailable))
            .collect();
        let errors: Vec<Option<(i64, String)>> = answers
            .iter()
            .map(|(_, r)| r.as_ref().map(Refused::error))
            .collect();
        let batch: Vec<BatchAnswer<'_>> = answers
            .iter()
            .zip(details)
            .zip(&errors)
            .map(|(((id, _), details), error)| match (details, error) {
                (Some(details), _) => BatchAnswer::Unavailable(id, details),
                (None, Some((code, message))) => BatchAnswer::Error(id, *code, message),
                (None, None) => BatchAnswer::NotRun(id),
            })
            .collect();
        let reply = reply::batch_refused(self.version, &batch, self.framing);
        self.reply_locally(host, 200, &reply)
    }

    /// Whether a prompt or resource request of a batch would be refused by the rules.
    pub(super) fn peek_surface(&self, service: &str, request: &Request<'_>) -> Option<Refused> {
        let shared = self.shared.borrow();
        let auth = shared.config.auth.as_ref()?;
        surface_items(request).into_iter().find_map(|(item, name)| {
            (auth.decide_service_item(service, item, &name, self.auth.caller())
                != AuthVerdict::Allow)
                .then(|| Refused::NotPermitted {
                    service: service.to_string(),
                    item,
                    name: name.into_owned(),
                })
        })
    }

    /// Whether one call of a batch would be refused, without taking a probe slot or
    /// creating any state.
    pub(super) fn peek_call(
        &self,
        service: &str,
        request: &Request<'_>,
        now: u64,
    ) -> Option<Refused> {
        let tool = match request.tool() {
            Some(ToolName::Valid(tool)) => tool,
            Some(ToolName::Invalid(_)) => return Some(Refused::Plain(Refusal::ToolNameInvalid)),
            _ => return Some(Refused::Plain(Refusal::ToolNameAbsent)),
        };
        if let Some(auth) = &self.shared.borrow().config.auth {
            if auth.decide_service(service, tool, self.auth.caller()) != AuthVerdict::Allow {
                return Some(Refused::NotPermitted {
                    service: service.to_string(),
                    item: Item::Tool,
                    name: tool.to_string(),
                });
            }
        }
        let mut guard = self.shared.borrow_mut();
        let Shared {
            config, breakers, ..
        } = &mut *guard;
        let policy = config.policy_for(service, tool);
        if let Some(reason) = fleet::forced_open(&config.overrides, service, tool) {
            return Some(Refused::ForcedOpen {
                tool: tool.to_string(),
                reason: reason.to_string(),
                fallback: policy.fallback_tool,
            });
        }
        match catalog::lookup(&config.catalog, service, tool) {
            Known::NotListed | Known::UnknownService | Known::Unlisted => return None,
            Known::Listed => {}
        }
        let key = breaker_key(service, tool);
        let (retry_after_ms, state) = match breakers.peek(&key, &policy, now) {
            Some(Admission::Allow) => return None,
            Some(Admission::Reject {
                retry_after_ms,
                state,
                ..
            }) => (retry_after_ms, state),
            // A probe is due: probes are judged one by one, not in a batch.
            Some(Admission::Probe { .. }) | None => (1000, State::HalfOpen),
        };
        let cause = breakers.snapshot(&key).and_then(|b| b.opened_by().cloned());
        Some(Refused::Breaker {
            tool: tool.to_string(),
            state,
            cause: open_cause(cause.as_ref()),
            retry_after_secs: retry_after_ms.div_ceil(1000).max(1),
            fallback: policy.fallback_tool,
        })
    }
}
