//! Who is calling and what they may do: the bearer token's verification (Envoy's
//! `jwt_authn` wrote its payload), the per-tool, per-resource and per-prompt rules of the
//! service and of the virtual server, the claims forwarded to servers, and the refusals
//! (401 with the resource metadata, 403 with the scope, JSON-RPC `-32003`).

use super::*;

impl<S: SharedStore, M: MetricHost> Call<S, M> {
    /// Reads who is calling (issue 20), when an auth configuration is on: the payload Envoy
    /// verified, and whether a token came at all. Neither the token nor the payload goes on
    /// upstream. A resource that requires a token and got no valid one is refused here with
    /// the 401 that starts an MCP client's OAuth flow.
    pub(super) fn authenticate(
        &mut self,
        host: &impl CallHost,
        target: Target<'_>,
    ) -> Option<Action> {
        let path = match target {
            Target::Service(service) => aggregate::service_path(service, ""),
            Target::Virtual { server, .. } => aggregate::endpoint_path(server),
        };
        let (required, verified, authorization, payload_seen) = {
            let mut guard = self.shared.borrow_mut();
            let Shared {
                config, callers, ..
            } = &mut *guard;
            let Some(auth) = config.auth.as_ref() else {
                // Envoy verified a token although this filter has no auth configuration: its
                // `jwt_authn` is ahead of this filter's configuration (one it refused, or not
                // yet here), and may keep tokens on requests for an exchange. The token does
                // not go on (a lookup in the headers read already); the payload header never
                // does, the route configuration removes it.
                if host.request_header_present(PAYLOAD_HEADER) {
                    host.set_request_header("authorization", None);
                }
                return None;
            };
            // Left in place: the route configuration removes it as the request goes upstream.
            let payload = host.request_header(PAYLOAD_HEADER);
            let authorization = host.request_header("authorization");
            if authorization.is_some() {
                // No token passthrough: the client's token is for the gateway alone.
                host.set_request_header("authorization", None);
            }
            // Envoy drops the token of a request it verified: a payload refused here (a token
            // for another resource) is a refused token too.
            let came = payload.is_some();
            // Kept only where a token may be exchanged: that token must be the one verified.
            let payload_seen = if config.exchanged.is_empty() {
                None
            } else {
                payload.clone()
            };
            let verified = payload
                // An Envoy whose bootstrap does not verify tokens first: the header could be
                // the client's own, so nothing is verified there (fail closed).
                .filter(|_| !auth.untrusted_payload)
                .and_then(|p| callers.get(p, &auth.roles_claim))
                .filter(|v| auth.audience_fits(&v.payload, &path));
            self.auth.refused = verified.is_none()
                && (came || authorization.as_deref().is_some_and(auth::is_bearer));
            let required = match target {
                Target::Service(s) => auth.requires_service(s),
                Target::Virtual { server, .. } => auth.requires_virtual(server),
            };
            (required, verified, authorization, payload_seen)
        };
        self.auth.path = path;
        self.auth.authorization = authorization;
        self.auth.payload = payload_seen;
        if let Some(v) = &verified {
            if !v.caller.subject.is_empty() {
                self.log_field(host, log_field::SUBJECT, &v.caller.subject);
            }
        }
        self.auth.verified = verified;
        if required && self.auth.verified.is_none() {
            let what = match target {
                Target::Service(s) => format!("the MCP service `{s}`"),
                Target::Virtual { .. } => format!("the MCP endpoint `{}`", self.auth.path),
            };
            let label = self.denial_label(target);
            return Some(self.refuse_unauthenticated(host, &label, &what, None));
        }
        if let Target::Service(service) = target {
            self.forward_claims(host, service);
        }
        None
    }

    /// The `service` label of a denial: a known service, `virtual:<name>`, or the overflow.
    pub(super) fn denial_label(&self, target: Target<'_>) -> String {
        let shared = self.shared.borrow();
        match target {
            Target::Service(s) if shared.config.catalog.contains_key(s) => s.to_string(),
            Target::Virtual { server, .. }
                if server == toolgate_model::virtual_server::DEFAULT_VIRTUAL
                    || shared.config.virtual_servers.contains_key(server) =>
            {
                format!("virtual:{server}")
            }
            _ => crate::stats::OVERFLOW.to_string(),
        }
    }

    pub(super) fn count_denial(&mut self, host: &impl CallHost, label: &str, denial: Denial) {
        self.shared
            .borrow_mut()
            .stats
            .count_named(auth::metric_name(label, denial));
        self.log_field(host, log_field::DENIED, denial.as_str());
        self.log_field(host, log_field::DECISION, "denied");
        self.log_field(host, log_field::REASON, denial.as_str());
    }

    /// The gateway's public base URL, for the metadata URL a challenge names.
    pub(super) fn auth_resource(&self) -> String {
        self.shared
            .borrow()
            .config
            .auth
            .as_ref()
            .map(|a| a.resource.clone())
            .unwrap_or_default()
    }

    /// 401: no valid token for a resource that requires one (`id`: the request's, once read).
    pub(super) fn refuse_unauthenticated(
        &mut self,
        host: &impl CallHost,
        label: &str,
        what: &str,
        id: Option<&RawId>,
    ) -> Action {
        let denial = if self.auth.refused {
            Denial::InvalidToken
        } else {
            Denial::MissingToken
        };
        self.count_denial(host, label, denial);
        let resource = self.auth_resource();
        let challenge = auth::unauthenticated_challenge(&resource, &self.auth.path, denial);
        let version =
            ProtocolVersion::from_header(host.request_header("mcp-protocol-version").as_deref());
        let reply = auth::unauthenticated_reply(version, id, what, denial, Framing::Json);
        self.send_local(host, 401, &reply, &[("www-authenticate", &challenge)])
    }

    /// Puts the verified claims a service asked for on its request, after removing whatever
    /// the client sent under those names.
    pub(super) fn forward_claims(&self, host: &impl CallHost, service: &str) {
        let shared = self.shared.borrow();
        let Some(rules) = shared
            .config
            .auth
            .as_ref()
            .and_then(|a| a.services.get(service))
        else {
            return;
        };
        for (claim, header) in &rules.claim_headers {
            let value = self
                .auth
                .verified
                .as_ref()
                .and_then(|v| v.payload.get(claim))
                .and_then(auth::claim_header_value);
            host.set_request_header(header, value.as_deref());
        }
    }

    /// Whether the caller may use `name` (a tool, a prompt, a resource URI) of `service`
    /// (shown as `visible` on virtual server `server`, for a request made there): `Some` is
    /// the answer when not.
    pub(super) fn authorize(
        &mut self,
        host: &impl CallHost,
        item: Item,
        service: &str,
        name: &str,
        on: Option<(&str, &str)>,
        id: &RawId,
    ) -> Option<Action> {
        let verdict = {
            let shared = self.shared.borrow();
            let auth = shared.config.auth.as_ref()?;
            let caller = self.auth.caller();
            let on_virtual =
                on.map(|(server, visible)| auth.decide_virtual_item(server, item, visible, caller));
            match on_virtual {
                Some(v) if v != AuthVerdict::Allow => v,
                _ => auth.decide_service_item(service, item, name, caller),
            }
        };
        let (label, what, shown) = match on {
            Some((server, visible)) => (
                if self.shared.borrow().config.catalog.contains_key(service) {
                    service.to_string()
                } else {
                    crate::stats::OVERFLOW.to_string()
                },
                format!("the MCP endpoint `{}`", aggregate::endpoint_path(server)),
                visible,
            ),
            None => (
                self.denial_label(Target::Service(service)),
                format!("the MCP service `{service}`"),
                name,
            ),
        };
        let version = self.version;
        let refusal = |scope: Option<&str>, framing| {
            auth::not_permitted_reply(version, id, item, shown, &what, scope, framing)
        };
        match verdict {
            AuthVerdict::Allow => None,
            AuthVerdict::Unauthenticated => {
                Some(self.refuse_unauthenticated(host, &label, &what, Some(id)))
            }
            AuthVerdict::InsufficientScope(scope) => {
                self.count_denial(host, &label, Denial::InsufficientScope);
                let resource = self.auth_resource();
                let challenge =
                    auth::insufficient_scope_challenge(&resource, &self.auth.path, &scope);
                let reply = refusal(Some(&scope), Framing::Json);
                Some(self.send_local(host, 403, &reply, &[("www-authenticate", &challenge)]))
            }
            AuthVerdict::Denied => {
                self.count_denial(host, &label, Denial::of(item));
                let reply = refusal(None, self.framing);
                Some(self.reply_locally(host, 200, &reply))
            }
        }
    }

    /// Whether this request's listing may hide items from its caller (see
    /// [`Self::listing_filtered_for`]).
    pub(super) fn listing_filtered(&self) -> bool {
        self.judged()
            .and_then(|j| j.list)
            .is_some_and(|listing| self.listing_filtered_for(listing))
    }

    /// Whether a `listing` here may hide items from its caller: the service's rules guard
    /// what it lists, or, on a virtual server, any rules do or a caller without a token may
    /// meet a service that requires one. Only such a listing is read whole (and, unreadable,
    /// not shown).
    pub(super) fn listing_filtered_for(&self, listing: Listing) -> bool {
        let shared = self.shared.borrow();
        let Some(auth) = &shared.config.auth else {
            return false;
        };
        let item = item_listed(listing);
        match (&self.on_virtual, &self.service) {
            (Some(_), _) => {
                auth.services
                    .values()
                    .chain(auth.virtual_servers.values())
                    .any(|rules| rules.guards(item))
                    || (self.auth.verified.is_none() && !auth.required.is_empty())
            }
            (None, Some(service)) => auth.guards(Some(service), None, item),
            (None, None) => false,
        }
    }

    /// Whether a listing shows `name` (a tool, a prompt, a resource URI or template) of
    /// `service` (as `visible` on `server`) to this caller.
    pub(super) fn may_list(
        &self,
        auth: &FilterAuth,
        item: Item,
        service: &str,
        name: &str,
        on: Option<(&str, &str)>,
    ) -> bool {
        let caller = self.auth.caller();
        on.is_none_or(|(server, visible)| {
            auth.decide_virtual_item(server, item, visible, caller) == AuthVerdict::Allow
        }) && auth.decide_service_item(service, item, name, caller) == AuthVerdict::Allow
    }

    /// Whether `service` requires a token for its tools (and so for everything else it
    /// serves) and this request presents none.
    pub(super) fn lacks_token_for(&self, service: &str) -> bool {
        self.shared
            .borrow()
            .config
            .auth
            .as_ref()
            .is_some_and(|a| a.requires_service(service))
            && self.auth.caller().is_none()
    }

    /// `Bearer <token>` when toolgate-xds requires one of the filters, else empty.
    pub(super) fn report_authorization(&self) -> String {
        crate::feedback::authorization(&self.shared.borrow().config.report_token)
    }
}
