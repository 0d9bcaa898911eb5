//! What an answer means for the breaker and the instance's health: the verdict of a status
//! or a body, the record in the window, and the reply that replaces a failure.

use super::*;

impl<S: SharedStore, M: MetricHost> Call<S, M> {
    /// A successful answer the filter cannot read (compressed): no evidence for or against
    /// the tool, so the call counts for nothing; a listing that must be filtered for this
    /// caller is not shown; anything else passes untouched.
    pub(super) fn unread_answer(&mut self, host: &impl CallHost, end_of_stream: bool) -> Action {
        self.shared.borrow_mut().stats.count(RESPONSES_UNREAD);
        self.record(host, Outcome::Ignored, Some(Kind::Ok));
        let listing = self.judged().is_some_and(|j| j.list.is_some());
        if !(listing && self.listing_filtered()) {
            return Action::Continue;
        }
        self.shared.borrow_mut().stats.count(TOOLS_LIST_UNREAD);
        let reply = self.unfilterable_reply();
        if end_of_stream {
            return self.replace_now(host, reply);
        }
        replacing(host, "200", reply.content_type);
        self.watch = Watch::Replace(reply);
        Action::Continue
    }

    pub(super) fn code_details(&self, host: &impl CallHost) -> String {
        host.property(&["response", "code_details"])
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// What the answer of a routed `resources/read` or `prompts/get` says of its instance.
    pub(super) fn surface_outcome(&mut self, host: &impl CallHost, kind: Option<Kind>) {
        let (Some(kind), Some(service)) = (kind, &self.service) else {
            return;
        };
        let Some(address) = host
            .property(&["upstream", "address"])
            .and_then(|b| String::from_utf8(b).ok())
            .filter(|a| !a.is_empty())
        else {
            return;
        };
        self.shared
            .borrow()
            .feedback
            .borrow_mut()
            .record(service, &address, kind);
    }

    /// Reads the upstream address of the admitted call, if not read yet.
    pub(super) fn read_endpoint(&mut self, host: &impl CallHost) {
        let Some(a) = self.exchange_mut().and_then(|e| e.admitted.as_mut()) else {
            return;
        };
        if !matches!(a.endpoint, Endpoint::Unread) {
            return;
        }
        a.endpoint = match host.property(&["upstream", "address"]) {
            Some(bytes) if !bytes.is_empty() => match String::from_utf8(bytes) {
                Ok(address) => Endpoint::Known(address),
                Err(_) => Endpoint::Unknown,
            },
            _ => Endpoint::Unknown,
        };
    }

    /// Whether this call's client cancelled it (`notifications/cancelled` on its session).
    pub(super) fn cancelled_by_client(&self, now_ms: u64) -> bool {
        let (Some(session), Some(judged)) = (&self.client_session, self.judged()) else {
            return false;
        };
        let shared = self.shared.borrow();
        cancel::cancelled(shared.breakers.store(), session, &judged.id, now_ms)
    }

    /// Records the outcome of the admitted call, once; `report` is what the call feedback
    /// says about its upstream instance, if anything.
    pub(super) fn record(&mut self, host: &impl CallHost, outcome: Outcome, report: Option<Kind>) {
        let Some(a) = self.exchange_mut().and_then(|e| e.admitted.take()) else {
            return;
        };
        let now = host.now_ms();
        // Whatever a call the client cancelled ended in is the client's doing.
        let against = matches!(
            outcome,
            Outcome::Failure | Outcome::Slow | Outcome::IsErrorResult
        );
        let (outcome, report) = if against && self.cancelled_by_client(now) {
            (Outcome::Ignored, None)
        } else {
            (outcome, report)
        };
        let transition = {
            let mut shared = self.shared.borrow_mut();
            if let (Some(kind), Endpoint::Known(address), Some(service)) =
                (report, &a.endpoint, &self.service)
            {
                shared.feedback.borrow_mut().record(service, address, kind);
            }
            if a.learning {
                // The server knew the name: an answer (a result, or an error that does not
                // blame the request) from a server that was reached.
                let known = outcome != Outcome::Ignored && report == Some(Kind::Ok);
                if let (true, Some(service)) = (known, &self.service) {
                    let Shared {
                        unlisted, breakers, ..
                    } = &mut *shared;
                    unlisted.learn(breakers.store(), service, &a.tool, now);
                }
                return;
            }
            if let Some(ids) = &a.metrics {
                shared.stats.outcome(ids, outcome, a.policy.count_is_error);
            }
            let t = shared
                .breakers
                .record(&a.key, &a.policy, now, a.admission, outcome);
            if let Some(t) = &t {
                shared.stats.transition(&a.key, t.to, t.at_ms);
            }
            t
        };
        if let Some(t) = transition {
            host.log(Level::Warn, &transition_line(&a.key, &t));
            if let Some(event) = self
                .service
                .as_deref()
                .and_then(|service| fleet::event_of(service, &a.tool, &t))
            {
                self.events.push(event);
            }
        }
    }

    /// Success or slow, by how long the call took; `is_error` is the tool's own `isError`.
    pub(super) fn record_answered(&mut self, host: &impl CallHost, is_error: bool) {
        let Some(a) = self.admitted() else { return };
        let outcome = if is_error {
            Outcome::IsErrorResult
        } else if host.now_ms().saturating_sub(a.started_ms) >= a.policy.slow_call_ms {
            Outcome::Slow
        } else {
            Outcome::Success
        };
        self.record(host, outcome, Some(Kind::Ok));
    }

    /// Records what a response says; returns the failure to answer in its place, if it is
    /// not the response the agent needs.
    pub(super) fn classified(
        &mut self,
        host: &impl CallHost,
        class: ResponseClass,
    ) -> Option<UpstreamFailure> {
        match class {
            ResponseClass::Result { is_error } => {
                self.record_answered(host, is_error);
                None
            }
            ResponseClass::Error { code } if is_client_fault(code) => {
                self.record(host, Outcome::Ignored, Some(Kind::Ok));
                None
            }
            // The tool's own failure; the server answered, so the instance is fine.
            ResponseClass::Error { .. } => {
                self.record(host, Outcome::Failure, Some(Kind::Ok));
                None
            }
            ResponseClass::TooLarge => {
                self.record(host, Outcome::Ignored, Some(Kind::Ok));
                None
            }
            // Not the response to this request: the agent would wait for it in vain.
            ResponseClass::Other | ResponseClass::Unparseable => {
                self.record(host, Outcome::Failure, Some(Kind::Ok));
                Some(UpstreamFailure::BadResponse)
            }
        }
    }

    /// Records an upstream failure of the admitted call and returns the reply for it.
    pub(super) fn upstream_failed(&mut self, host: &impl CallHost, what: UpstreamFailure) -> Reply {
        self.record(host, Outcome::Failure, Kind::of_failure(what));
        self.failure_reply(what, self.framing)
    }

    /// The service's bulkhead refused the call: not the tool's fault.
    pub(super) fn overloaded(&mut self, host: &impl CallHost) -> Reply {
        self.record(host, Outcome::Ignored, None);
        self.tool_reply(UnavailableKind::Overloaded, self.framing)
    }

    /// [`failure_reply`](Self::failure_reply) for an upstream reset, in JSON: the reply Envoy
    /// sends should the upstream cut off an answer the filter holds.
    pub(super) fn cut_reply(&self) -> Vec<u8> {
        let write = || self.failure_reply(UpstreamFailure::Reset, Framing::Json);
        let Some(judged) = self.judged() else {
            return write().body;
        };
        let (tool, fallback) = judged.tool.clone().unzip();
        let key = (tool.unwrap_or_default(), fallback.flatten(), self.version);
        self.shared
            .borrow_mut()
            .cut_replies
            .reply(key, &judged.id, write)
    }

    pub(super) fn failure_reply(&self, what: UpstreamFailure, framing: Framing) -> Reply {
        self.tool_reply(UnavailableKind::UpstreamFailure { what }, framing)
    }

    /// The semantic reply for the admitted call of this request.
    pub(super) fn tool_reply(&self, kind: UnavailableKind<'_>, framing: Framing) -> Reply {
        let Some(judged) = self.judged() else {
            // Only admitted calls (which have a judged request) get here.
            return reply::refused(self.version, None, Refusal::NotAMessage, framing);
        };
        let (tool, fallback) = match &judged.tool {
            Some((tool, fallback)) => (Some(tool.as_str()), fallback.as_deref()),
            None => (None, None),
        };
        let details = Unavailable {
            kind,
            tool,
            retry_after_secs: None,
            fallback_tool: fallback,
        };
        reply::tool_unavailable(self.version, &judged.id, &details, framing)
    }
}
