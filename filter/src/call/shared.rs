//! What every call of one VM shares: the configuration, the breakers, the metrics, the
//! feedback to toolgate-xds, and the breaker transitions as log lines.

use super::*;

/// What a configuration's session key does to session ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sealing {
    /// No key: ids pass as the servers wrote them.
    Off,
    /// Ids are sealed with the key.
    On,
    /// A key that is not 32 bytes of base64: ids pass unsealed (and the operator is told).
    BadKey,
}

/// What every call of one worker VM shares.
pub struct Shared<S, M> {
    pub config: FilterConfig,
    pub breakers: Breakers<S>,
    pub stats: Stats<M>,
    /// Shared by every root context of the VM (see `host::root`): a new configuration's root
    /// takes over the counts the old one had not posted.
    pub feedback: Rc<RefCell<Feedback>>,
    pub unlisted: Unlisted,
    /// Seals `Mcp-Session-Id` when the configuration carries a key.
    pub sealer: Option<Sealer>,
    /// The names the virtual servers of `config` show, by (service, tool).
    pub visible: VisibleNames,
    /// No configuration was ever accepted by this VM (see [`crate::keeper`]): every request
    /// on an MCP path is refused.
    pub unconfigured: bool,
    /// Verified payloads read lately (agents send one token many times).
    pub(super) callers: auth::CallerCache,
    /// The reply for a held answer cut off upstream, by (tool as the agent sees it, its
    /// fallback, revision): set on every call whose answer is held.
    pub(super) cut_replies: reply::ById<(String, Option<String>, ProtocolVersion)>,
    /// Credentials toolgate-xds exchanged for callers (see `credential`).
    pub(super) credentials: super::CredentialCache,
    /// Call-limit tokens this worker took in batches and has not spent yet.
    pub(super) limit_tokens: RefCell<crate::limits::Local>,
}

impl<S: SharedStore, M: MetricHost> Shared<S, M> {
    pub fn new(store: S, metrics: M, seed: u64) -> Self {
        Shared {
            config: FilterConfig::default(),
            breakers: Breakers::new(store, seed),
            stats: Stats::new(metrics),
            feedback: Rc::new(RefCell::new(Feedback::new())),
            unlisted: Unlisted::new(),
            sealer: None,
            visible: VisibleNames::default(),
            unconfigured: false,
            callers: auth::CallerCache::default(),
            cut_replies: reply::ById::default(),
            credentials: super::CredentialCache::default(),
            limit_tokens: RefCell::default(),
        }
    }

    /// Takes a new configuration, and says whether its session key seals session ids.
    pub fn configure(&mut self, config: FilterConfig) -> Sealing {
        let key = config.session_key.0.clone();
        self.visible = VisibleNames::new(&config.virtual_servers);
        // The roles claim may have changed, and so may fallbacks.
        self.callers = auth::CallerCache::default();
        self.cut_replies = reply::ById::default();
        // An exchange's audience or scopes may have changed.
        self.credentials = super::CredentialCache::default();
        // A limit or the fleet's size changed: batches taken under the old shares go.
        if self.config.limits != config.limits {
            self.limit_tokens.borrow_mut().clear();
        }
        self.config = config;
        self.unconfigured = false;
        if key.is_empty() {
            self.sealer = None;
            return Sealing::Off;
        }
        self.sealer = Sealer::new(&key);
        match self.sealer {
            Some(_) => Sealing::On,
            None => Sealing::BadKey,
        }
    }

    /// Why a call of `tool` of `service` would be refused now, as a service's `tools/list`
    /// shows it: forced open by an operator, or its breaker open, fleet-wide or in this
    /// Envoy. A breaker still carrying a lifted override is not shown: the next configuration
    /// clears it.
    pub(super) fn availability(
        &self,
        service: &str,
        tool: &str,
        now_ms: u64,
    ) -> Option<Availability> {
        let config = &self.config;
        let why = match fleet::forced_open(&config.overrides, service, tool) {
            Some(reason) => NotNow::ForcedOpen {
                reason: reason.to_string(),
            },
            None => {
                let fleet = config
                    .fleet_open
                    .get(service)
                    .and_then(|t| t.get(tool))
                    .map(|o| o.until_ms);
                let here = self
                    .breakers
                    .snapshot(&breaker_key(service, tool))
                    .filter(|b| b.state() == State::Open && b.force() == Force::None)
                    .map(|b| b.open_until_ms());
                let until_ms = fleet.max(here).filter(|&until| until > now_ms)?;
                NotNow::Open { until_ms }
            }
        };
        // On a service's route the agent sees the tools' own names.
        let fallback = config.policy_for(service, tool).fallback_tool;
        Some(Availability { why, fallback })
    }
}

/// The log line of a breaker transition.
pub fn transition_line(key: &str, t: &Transition) -> String {
    let until = t
        .open_until_ms
        .map(|u| format!(", probing after {} ms", u.saturating_sub(t.at_ms)))
        .unwrap_or_default();
    format!(
        "toolgate breaker {key}: {} -> {} ({}){until}",
        t.from, t.to, t.cause
    )
}
