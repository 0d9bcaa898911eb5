//! The request's life as a state machine: each state holds only what is valid in it, and
//! [`Call::enter`] is the one place a request moves from one to the next.
//!
//! ```text
//!            headers                       body / trailers
//! Ignored ─┬──────────▶ Reading ─────────────────────────▶ Judged ──▶ Answered
//!          │              └──(refused: length, encoding)──────────────▶ Answered
//!          ├─ GET, DELETE ─▶ AwaitingEmptyBody ─┬─ empty ─▶ Stream | Passed
//!          │                                    └─ a byte ────────────▶ Answered
//!          ├─ GET stream, no body ─▶ Stream
//!          ├─ DELETE, aggregate GET, no body ─▶ Passed
//!          ├─ no configuration, POST ─▶ Unconfigured ─ body ─────────▶ Answered
//!          └─ refused at once (method, header, token, configuration) ──▶ Answered
//! Stream, Passed, Judged ── an answer that failed, replaced whole ──▶ Answered
//! ```
//!
//! The answer has states of its own ([`Watch`]), entered from its headers in `Stream`,
//! `Passed` (an aggregate request toolgate-xds did not answer) and `Judged`. What else holds a
//! phase: the session held for the client ([`HeldCall::phase`]: opening, sent, checking a 400,
//! replaying), only in `Judged` past `Opening`'s resume, and a request of the aggregate
//! endpoint sent to a service's route ([`OnVirtual::routed`]), only in `Judged`.

use super::*;

/// Where one request is in its life through the filter.
pub(super) enum Life {
    /// Not a request the filter reads (another path), or not yet read.
    Ignored,
    /// A GET or DELETE whose headers wait until it is clear no body follows (a server that
    /// read a body there like a POST's would run a call nobody judged). `stream`: a GET
    /// stream of a service, which becomes [`Life::Stream`].
    AwaitingEmptyBody { stream: bool },
    /// An MCP GET stream of a service, passed on: only an Envoy-made failure is answered, in
    /// MCP's terms.
    Stream,
    /// Passed on with no body to judge: a DELETE, or a GET stream of the aggregate endpoint
    /// (toolgate-xds's).
    Passed,
    /// A POST whose body is held for judging.
    Reading(Reading),
    /// A POST this VM cannot judge (it has no configuration): its body is read only for the
    /// id of the refusal.
    Unconfigured { body_len: usize },
    /// The body was whole and judged: the request went on (or is about to), and what the
    /// judging decided is kept for its answer.
    Judged(Box<Exchange>),
    /// The filter answered the request itself: nothing of it goes on.
    Answered,
}

/// What the request's headers and body said while it was held for judging.
#[derive(Default)]
pub(super) struct Reading {
    pub(super) body_len: usize,
    /// `Mcp-Method` and `Mcp-Name`, checked against the body.
    pub(super) header_method: Option<String>,
    pub(super) header_name: Option<String>,
    /// The request declared its body's length (`content-length`), which a rewrite must keep
    /// true.
    pub(super) declared_length: bool,
}

/// A judged request, until its answer is through.
pub(super) struct Exchange {
    /// The body as it was read.
    pub(super) read: Reading,
    /// The request (a JSON-RPC request; a notification or a client's answer has none).
    pub(super) request: Option<Judged>,
    /// A `tools/call` that went upstream under a breaker, until its outcome is recorded.
    pub(super) admitted: Option<Admitted>,
    /// A stateless client's call answered on a session held for it: the answer is held
    /// whole and its results completed for the client's revision
    /// ([`held_session::complete_results`]).
    pub(super) completing: bool,
    /// An answer routed from a virtual server, edited as it passes (see [`AnswerEdit`]).
    pub(super) edit: Option<AnswerEdit>,
    /// A `resources/read` or `prompts/get` of the aggregate endpoint sent to its service.
    pub(super) surface: Option<Surface>,
}

/// A request about a resource or a prompt routed from the aggregate endpoint: its answer
/// counts for or against the instance (health feedback), never for a breaker.
pub(super) struct Surface {
    /// The server's URI and the one the agent read, when the gateway rewrote it.
    pub(super) rewritten_uri: Option<(String, String)>,
}

impl Life {
    /// Whether a request may move from this state to `next`.
    fn may_become(&self, next: &Life) -> bool {
        use Life::*;
        match (self, next) {
            (Ignored, Judged(_)) => false,
            (Ignored, _) => true,
            (AwaitingEmptyBody { stream }, Stream) => *stream,
            (AwaitingEmptyBody { stream }, Passed) => !*stream,
            (AwaitingEmptyBody { .. }, Answered) => true,
            (Reading(_), Judged(_) | Answered) => true,
            (Unconfigured { .. }, Answered) => true,
            // A request that went on is answered by the filter when its answer failed.
            (Stream | Passed | Judged(_), Answered) => true,
            _ => false,
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Life::Ignored => "ignored",
            Life::AwaitingEmptyBody { .. } => "awaiting an empty body",
            Life::Stream => "stream",
            Life::Passed => "passed",
            Life::Reading(_) => "reading",
            Life::Unconfigured { .. } => "unconfigured",
            Life::Judged(_) => "judged",
            Life::Answered => "answered",
        }
    }
}

impl Exchange {
    pub(super) fn new(read: Reading) -> Box<Self> {
        Box::new(Exchange {
            read,
            request: None,
            admitted: None,
            completing: false,
            edit: None,
            surface: None,
        })
    }
}

impl<S: SharedStore, M: MetricHost> Call<S, M> {
    /// Moves the request to `next`, returning the state it leaves. A move the diagram above
    /// does not have is a bug in the filter: tests fail on it; a release build logs nothing
    /// (it has no host here) and moves, since refusing to would strand the request.
    pub(super) fn enter(&mut self, next: Life) -> Life {
        debug_assert!(
            self.life.may_become(&next),
            "a request cannot move from {} to {}",
            self.life.name(),
            next.name()
        );
        std::mem::replace(&mut self.life, next)
    }

    /// Sends a local reply and stops the request there.
    pub(super) fn send_local(
        &mut self,
        host: &impl CallHost,
        status: u32,
        reply: &Reply,
        headers: &[(&str, &str)],
    ) -> Action {
        if !matches!(self.life, Life::Answered) {
            self.enter(Life::Answered);
        }
        host.send_reply(status, reply, headers);
        Action::Pause
    }

    pub(super) fn exchange(&self) -> Option<&Exchange> {
        match &self.life {
            Life::Judged(exchange) => Some(exchange),
            _ => None,
        }
    }

    pub(super) fn exchange_mut(&mut self) -> Option<&mut Exchange> {
        match &mut self.life {
            Life::Judged(exchange) => Some(exchange),
            _ => None,
        }
    }

    /// The request as judged, once it was.
    pub(super) fn judged(&self) -> Option<&Judged> {
        self.exchange()?.request.as_ref()
    }

    /// Keeps what the judging read of a request.
    pub(super) fn note_request(&mut self, judged: Judged) {
        if let Some(exchange) = self.exchange_mut() {
            exchange.request = Some(judged);
        }
    }

    /// The call goes upstream under its breaker; `tool`: the tool and the fallback its
    /// replies name, as the agent knows them.
    pub(super) fn admit(&mut self, admitted: Admitted, tool: (String, Option<String>)) {
        if let Some(exchange) = self.exchange_mut() {
            if let Some(judged) = &mut exchange.request {
                judged.tool = Some(tool);
            }
            exchange.admitted = Some(admitted);
        }
    }

    pub(super) fn admitted(&self) -> Option<&Admitted> {
        self.exchange()?.admitted.as_ref()
    }

    /// The body as it was read, while or after it was held.
    pub(super) fn read(&self) -> Option<&Reading> {
        match &self.life {
            Life::Reading(read) => Some(read),
            Life::Judged(exchange) => Some(&exchange.read),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every() -> Vec<Life> {
        vec![
            Life::Ignored,
            Life::AwaitingEmptyBody { stream: true },
            Life::AwaitingEmptyBody { stream: false },
            Life::Stream,
            Life::Passed,
            Life::Reading(Reading::default()),
            Life::Unconfigured { body_len: 0 },
            Life::Judged(Exchange::new(Reading::default())),
            Life::Answered,
        ]
    }

    #[test]
    fn answered_is_final_and_what_went_on_can_only_be_answered() {
        for to in every() {
            assert!(!Life::Answered.may_become(&to), "answered -> {}", to.name());
            for from in [Life::Stream, Life::Passed] {
                let answered = matches!(to, Life::Answered);
                assert_eq!(
                    from.may_become(&to),
                    answered,
                    "{} -> {}",
                    from.name(),
                    to.name()
                );
            }
        }
    }

    #[test]
    fn only_a_read_body_is_judged() {
        for from in every() {
            let judged = Life::Judged(Exchange::new(Reading::default()));
            assert_eq!(
                from.may_become(&judged),
                matches!(from, Life::Reading(_)),
                "{}",
                from.name()
            );
        }
    }

    #[test]
    fn every_state_but_the_final_ones_can_be_answered() {
        for from in every() {
            let open = !matches!(from, Life::Answered);
            assert_eq!(from.may_become(&Life::Answered), open, "{}", from.name());
        }
    }
}
