//! The credential of a service whose servers take each caller's own token, exchanged (RFC 8693)
//! by toolgate-xds: asked for when the request's headers are read, cached per worker until
//! shortly before it expires, and put on the request in place of the client's token. A request
//! is never sent on without it: a refused or failed exchange is answered in MCP, naming why.
//!
//! The question runs while the body is read and judged: only the request's going on waits for
//! the answer (see [`Call::go_on`]), so a warm cache costs one map lookup and one header.

use std::collections::HashMap;

use super::*;

/// Where the filters ask toolgate-xds for a caller's credential toward a service.
pub const EXCHANGE_PATH: &str = "/v1/token-exchange";
/// Credentials kept per worker; past this the cache starts over (a flood of distinct tokens
/// costs toolgate-xds's cache, not this VM's memory).
pub const MAX_CACHED: usize = 1024;
/// A `why` from toolgate-xds longer than this is cut (it is shown to a model).
const MAX_WHY_BYTES: usize = 300;

/// The credentials toolgate-xds exchanged, by service, then by the caller's token (looked up
/// by `&str`, without allocating).
#[derive(Default)]
pub struct CredentialCache {
    entries: HashMap<String, HashMap<String, Cached>>,
    count: usize,
}

struct Cached {
    header: String,
    value: String,
    until_ms: u64,
}

impl CredentialCache {
    fn get(&self, service: &str, token: &str, now_ms: u64) -> Option<(&str, &str)> {
        let e = self.entries.get(service)?.get(token)?;
        (now_ms < e.until_ms).then_some((e.header.as_str(), e.value.as_str()))
    }

    fn put(&mut self, service: &str, token: &str, answer: Answer, now_ms: u64) {
        if self.count >= MAX_CACHED {
            for tokens in self.entries.values_mut() {
                tokens.retain(|_, e| now_ms < e.until_ms);
            }
            self.entries.retain(|_, tokens| !tokens.is_empty());
            self.count = self.entries.values().map(HashMap::len).sum();
            if self.count >= MAX_CACHED {
                self.entries.clear();
                self.count = 0;
            }
        }
        let tokens = self.entries.entry(service.to_string()).or_default();
        let fresh = tokens.insert(
            token.to_string(),
            Cached {
                header: answer.header,
                value: answer.value,
                until_ms: now_ms.saturating_add(answer.use_for_ms),
            },
        );
        if fresh.is_none() {
            self.count += 1;
        }
    }
}

/// toolgate-xds's answer.
#[derive(Deserialize)]
struct Answer {
    header: String,
    value: String,
    use_for_ms: u64,
}

/// toolgate-xds's refusal: why, in words for the agent.
#[derive(Deserialize)]
struct Refusal {
    failure: String,
    why: String,
}

/// Where the request's credential stands.
#[derive(Debug, Default)]
pub(super) enum CredentialState {
    /// The service takes none, or it is on the request.
    #[default]
    None,
    /// Asked for (the callout's token); `waiting`: the request is ready to go on and paused
    /// until the answer.
    Asking { token: u32, waiting: bool },
    /// None could be had: answered in MCP as soon as the request can be.
    Failed { why: String, lasting: bool },
}

use serde::Deserialize;

impl<S: SharedStore, M: MetricHost> Call<S, M> {
    /// For a service whose servers take each caller's own credential: puts it on the request
    /// or asks for it. `Some`: the request is refused.
    pub(super) fn credential_for(&mut self, host: &impl CallHost, service: &str) -> Option<Action> {
        if !self.shared.borrow().config.exchanged.contains_key(service) {
            return None;
        }
        let authorization = self.auth.authorization.take();
        self.ask_credential(host, service, authorization)
    }

    /// Puts `service`'s credential for this caller on the request, or asks toolgate-xds for
    /// it. `Some`: the request is refused (no verified token to exchange).
    fn ask_credential(
        &mut self,
        host: &impl CallHost,
        service: &str,
        bearer: Option<String>,
    ) -> Option<Action> {
        let token = bearer.as_deref().and_then(|a| {
            let a = a.trim();
            auth::is_bearer(a).then(|| a[7..].trim())
        });
        // The token in `Authorization` must be the one Envoy verified (its payload segment is
        // the payload forwarded): one verified from elsewhere (the `access_token` query
        // parameter) beside another in the header would otherwise lend one caller's rules to
        // another's credential.
        let verified_here = |t: &str| {
            self.auth.verified.is_some()
                && self
                    .auth
                    .payload
                    .as_deref()
                    .is_some_and(|p| t.split('.').nth(1) == Some(p))
        };
        let token = match token {
            Some(t) if !t.is_empty() && verified_here(t) => t.to_string(),
            // No token to exchange (none, refused, or not the verified one in the
            // Authorization header): the 401 that starts the client's OAuth flow.
            _ => {
                let label = self.denial_label(Target::Service(service));
                let what = format!("the MCP service `{service}`");
                return Some(self.refuse_unauthenticated(host, &label, &what, None));
            }
        };
        let now = host.now_ms();
        {
            let shared = self.shared.borrow();
            if let Some((header, value)) = shared.credentials.get(service, &token, now) {
                host.set_request_header(header, Some(value));
                return None;
            }
        }
        let question = serde_json::json!({"service": service, "subject_token": token});
        let body = question.to_string();
        match host.dispatch(EXCHANGE_PATH, body.as_bytes(), &self.report_authorization()) {
            Some(callout) => {
                self.credential = CredentialState::Asking {
                    token: callout,
                    waiting: false,
                };
                self.asked_credential = Some((service.to_string(), token));
            }
            None => {
                self.credential = CredentialState::Failed {
                    why: format!(
                        "the gateway cannot get one for {service} while its control plane is \
                         unreachable"
                    ),
                    lasting: false,
                };
            }
        }
        None
    }

    /// Whether `callout` is this request's question about its credential.
    pub(super) fn is_credential_answer(&self, callout: u32) -> bool {
        matches!(self.credential, CredentialState::Asking { token, .. } if token == callout)
    }

    /// toolgate-xds answered the question about the credential.
    pub(super) fn on_credential(
        &mut self,
        host: &impl CallHost,
        status: Option<u16>,
        body: &[u8],
    ) -> Action {
        let waiting = matches!(
            self.credential,
            CredentialState::Asking { waiting: true, .. }
        );
        let asked = self.asked_credential.take();
        let answer = match status {
            Some(200) => serde_json::from_slice::<Answer>(body).ok(),
            _ => None,
        };
        let service = asked.as_ref().map(|(s, _)| s.as_str()).unwrap_or_default();
        match (answer, asked.as_ref()) {
            (Some(answer), Some((service, token))) if header_safe(&answer) => {
                host.set_request_header(&answer.header, Some(&answer.value));
                self.shared
                    .borrow_mut()
                    .credentials
                    .put(service, token, answer, host.now_ms());
                self.credential = CredentialState::None;
            }
            _ => {
                let refusal = serde_json::from_slice::<Refusal>(body).ok();
                let (why, lasting) = match (&refusal, status) {
                    (Some(r), Some(_)) => (
                        bounded(&r.why),
                        r.failure != "unreachable" && r.failure != "timeout",
                    ),
                    (_, None) => (
                        format!(
                            "the gateway could not get one for {service}: its control plane \
                             did not answer"
                        ),
                        false,
                    ),
                    (None, Some(status)) => (
                        format!(
                            "the gateway could not get one for {service}: its control plane \
                             answered HTTP {status}"
                        ),
                        false,
                    ),
                };
                host.log(
                    Level::Warn,
                    &format!("toolgate: no credential for a caller of service {service}: {why}"),
                );
                self.credential = CredentialState::Failed { why, lasting };
            }
        }
        if matches!(self.life, Life::Answered) || !waiting {
            return Action::Continue;
        }
        self.go_on(host)
    }

    /// The request is ready to go on: it does once its credential is on it. Returns what to
    /// tell Envoy from a callback that would have let it go on (`action`).
    pub(super) fn gate(&mut self, host: &impl CallHost, action: Action) -> Action {
        if action != Action::Continue || matches!(self.life, Life::Answered) {
            return action;
        }
        match &mut self.credential {
            CredentialState::None => Action::Continue,
            CredentialState::Asking { waiting, .. } => {
                *waiting = true;
                Action::Pause
            }
            CredentialState::Failed { .. } => self.no_credential(host),
        }
    }

    /// Lets a paused request go on (after a question of its own was answered), once its
    /// credential is on it.
    pub(super) fn go_on(&mut self, host: &impl CallHost) -> Action {
        match &mut self.credential {
            CredentialState::None => {
                host.resume_request();
                Action::Continue
            }
            CredentialState::Asking { waiting, .. } => {
                *waiting = true;
                Action::Continue
            }
            CredentialState::Failed { .. } => {
                self.no_credential(host);
                Action::Continue
            }
        }
    }

    /// Answers the request: no credential could be had, and it never goes without one.
    fn no_credential(&mut self, host: &impl CallHost) -> Action {
        let CredentialState::Failed { why, lasting } = std::mem::take(&mut self.credential) else {
            return Action::Continue;
        };
        // A breaker's trial call that was not made counts for nothing.
        self.record(host, Outcome::Ignored, None);
        let kind = UnavailableKind::NoCredential { why: &why, lasting };
        if self.judged().is_some_and(|j| j.tool.is_some()) {
            let reply = self.tool_reply(kind, self.framing);
            return self.send_local(host, 200, &reply, &[]);
        }
        // Another method: a JSON-RPC error with its id; a GET stream (no id): a 502.
        let (id, framing, status) = match self.judged() {
            Some(judged) => (Some(&judged.id), self.framing, 200),
            None => (None, Framing::Json, 502),
        };
        let service = self.service.as_deref().unwrap_or_default();
        let message = format!(
            "The gateway could not get a credential for this caller toward the MCP service \
             `{service}`: {}.",
            reply::clean_reason(&why)
        );
        let reply = reply::error(
            self.version,
            id,
            reply::INTERNAL_ERROR,
            &message,
            None::<()>,
            framing,
        );
        self.send_local(host, status, &reply, &[])
    }
}

/// A header toolgate-xds named and its value: nothing Envoy would refuse or split.
fn header_safe(a: &Answer) -> bool {
    !a.header.is_empty()
        && a.header
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        && !a.value.is_empty()
        && !a.value.chars().any(|c| c.is_control())
}

fn bounded(why: &str) -> String {
    let mut end = why.len().min(MAX_WHY_BYTES);
    while !why.is_char_boundary(end) {
        end -= 1;
    }
    why[..end].to_string()
}
