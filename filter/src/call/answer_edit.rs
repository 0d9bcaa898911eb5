//! Answers edited as they pass from a service to a client of a virtual server: resource
//! links shown as the endpoint shows its resources, the server's questions under ids
//! naming it (see `crate::asked`). JSON held whole, SSE edited at event boundaries.

use super::*;

/// What the filter edits in an answer routed from a virtual server to one of its services.
pub(super) struct AnswerEdit {
    pub(super) server: String,
    pub(super) service: String,
    /// A tool's result or a prompt where the virtual server offers resources: resource links
    /// and embedded resources get the URIs that lead back to them there.
    pub(super) links: bool,
    /// A call's stream on a client session: the server's questions get ids naming it
    /// (`crate::asked`), so two servers' questions never share one.
    pub(super) questions: bool,
    /// The answer is an SSE stream (edited event by event), else one JSON message.
    pub(super) sse: bool,
}

impl<S: SharedStore, M: MetricHost> Call<S, M> {
    /// Decides, with the answer's headers, what of it to edit as it passes: resource links
    /// (asked for by the request, see [`Self::watch_links`]) and the server's questions (on
    /// the SSE stream of a call routed on a client's session). Nothing of an answer that
    /// failed, is compressed or has no body.
    pub(super) fn plan_edit<H: CallHost>(
        &mut self,
        host: &H,
        head: &AnswerHead<'_, H>,
        encoded: bool,
        end_of_stream: bool,
    ) {
        let routed = self.on_virtual.as_ref().filter(|v| v.routed);
        let (Some(on), Some(service)) = (routed, &self.service) else {
            self.drop_edit();
            return;
        };
        let planned = self.exchange().is_some_and(|e| e.edit.is_some());
        if !planned && self.client_session.is_none() {
            // No links asked for, and no client to ask questions of.
            return;
        }
        if !head.success() || encoded || end_of_stream {
            self.drop_edit();
            return;
        }
        let sse = head.is_sse();
        let questions = sse && self.client_session.is_some();
        let (server, service) = (on.server.clone(), service.clone());
        let Some(exchange) = self.exchange_mut() else {
            return;
        };
        match exchange.edit.as_mut() {
            Some(edit) => {
                edit.sse = sse;
                edit.questions = questions;
            }
            None if questions => {
                exchange.edit = Some(AnswerEdit {
                    server,
                    service,
                    links: false,
                    questions,
                    sse,
                });
            }
            // Nothing to edit: a JSON answer to a request that asked for no links.
            None => return,
        }
        // An edited answer is longer.
        host.set_response_header("content-length", None);
    }

    fn drop_edit(&mut self) {
        if let Some(exchange) = self.exchange_mut() {
            exchange.edit = None;
        }
    }

    /// Whether an edit of the answer is planned (see [`Self::plan_edit`]).
    pub(super) fn edits_answer(&self) -> bool {
        self.exchange().is_some_and(|e| e.edit.is_some())
    }

    /// The answer so far edited (see [`AnswerEdit`]): the body as it goes on after that (so
    /// that what reads it next need not copy it again), or `None` to wait for more (a JSON
    /// answer until it is whole, an SSE stream until an event ends). An answer too large to
    /// hold goes as the server wrote it.
    pub(super) fn edit_answer(
        &mut self,
        host: &impl CallHost,
        body_size: usize,
        end_of_stream: bool,
    ) -> Option<Vec<u8>> {
        let body = host.response_body(body_size).unwrap_or_default();
        let Some(edit) = self.exchange().and_then(|e| e.edit.as_ref()) else {
            return Some(body);
        };
        let whole = end_of_stream || (edit.sse && resource_uri::ends_an_event(&body));
        if !whole {
            if body_size <= HOLD_LIMIT {
                return None;
            }
            host.log(
                Level::Info,
                &format!(
                    "toolgate: an answer of `{}` too large to hold passes with its resource URIs and question ids as the server wrote them",
                    edit.service
                ),
            );
            self.drop_edit();
            return Some(body);
        }
        let links = edit.links && resource_uri::may_hold_links(&body);
        let questions = edit.questions && memchr::memmem::find(&body, b"\"method\"").is_some();
        let edited = if links || questions {
            let shared = self.shared.borrow();
            let routes = shared.config.virtual_servers.get(&edit.server);
            let shown = |uri: &str| match routes.map(|r| r.shown_uri(&edit.service, uri)) {
                Some(std::borrow::Cow::Owned(shown)) => Some(shown),
                _ => None,
            };
            resource_uri::edit_messages(&body, |message| {
                let mut changed = false;
                if questions {
                    changed |= asked::rename_questions(message, &edit.service);
                }
                if links {
                    changed |= resource_uri::rewrite_links_in(message, &shown);
                }
                changed
            })
        } else {
            None
        };
        if end_of_stream {
            self.drop_edit();
        }
        match edited {
            Some(edited) => {
                host.set_response_body(body_size, &edited);
                Some(edited)
            }
            None => Some(body),
        }
    }
}
