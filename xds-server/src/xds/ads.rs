//! ADS, state of the world (the incremental variant is `delta.rs`): each response of a type
//! carries every resource of it the Envoy subscribed (EDS: those it lacks), under the type's
//! version. The stream itself (its loop, the node, ACK and NACK bookkeeping) is `stream.rs`'s.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use envoy_types::pb::google::protobuf::Any;
use tracing::debug;

use super::cache::{CacheSnapshot, TypeSnapshot};
use super::node::{NodeView, Tailored};
use super::resources::ResourceType;
use super::stream::{control_plane, Closed, Envoy, Protocol, Unanswered};

/// What an Envoy subscribed for one type.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Subscription {
    /// Everything of the type (CDS with no names, or any type with `*`).
    Wildcard,
    Names(BTreeSet<String>),
}

impl Subscription {
    fn from_request(ty: ResourceType, names: &[String]) -> Subscription {
        if names.iter().any(|n| n == "*") || (names.is_empty() && ty.empty_names_mean_wildcard()) {
            Subscription::Wildcard
        } else {
            Subscription::Names(names.iter().cloned().collect())
        }
    }

    /// Whether a response computed for `self` answered everything `other` asks for.
    fn covers(&self, other: &Subscription) -> bool {
        match (self, other) {
            (Subscription::Wildcard, _) => true,
            (Subscription::Names(_), Subscription::Wildcard) => false,
            (Subscription::Names(mine), Subscription::Names(theirs)) => theirs.is_subset(mine),
        }
    }
}

/// Protocol state of one type on one stream.
#[derive(Debug)]
struct TypeState {
    subscription: Subscription,
    /// The subscription the last response was computed for; `None` before the first (not the
    /// names it held: a subscribed name toolgate does not know is covered, or every ACK would
    /// trigger another response). A stale request's subscription is ignored (its ACK or NACK
    /// is not).
    sent_for: Option<Subscription>,
    /// Not EDS: last version Envoy rejected. It is never sent again on this stream: Envoy
    /// would reject it again, in a loop. The next different version is sent as usual. EDS
    /// keeps rejections per assignment instead (`rejected`, `suspects`): a rejected version
    /// must not hold back the other assignments it carried, nor the assignments re-created
    /// clusters wait for.
    nacked: Option<String>,
    /// EDS only: CDS was sent after the last EDS response. Envoy's new and changed clusters
    /// warm until they receive an assignment, even one whose version has not changed, so the
    /// next EDS push or request is answered regardless of versions.
    answer_next: bool,
    /// EDS only: the content hash of each assignment as last delivered on this stream (sent,
    /// and not known to be rejected). A push sends only the assignments that differ: a SotW
    /// EDS response may omit resources, and Envoy then leaves those clusters alone instead of
    /// re-applying a thousand unchanged ones.
    delivered: HashMap<String, u64>,
    /// EDS only: assignments Envoy rejected in a response that carried nothing else, by
    /// content hash. Not sent again in that form (Envoy would reject it again, in a loop); the
    /// next change of the assignment goes out as usual.
    rejected: HashMap<String, u64>,
    /// EDS only: assignments that were in a rejected response together with others. Envoy
    /// validates every resource of a response before applying any, so it applied none of
    /// them: each goes again in a response of its own, until Envoy accepts it or rejects it
    /// alone. One invalid assignment cannot hold back the rest.
    suspects: BTreeSet<String>,
}

impl TypeState {
    fn new(ty: ResourceType) -> TypeState {
        TypeState {
            subscription: Subscription::from_request(ty, &[]),
            sent_for: None,
            nacked: None,
            answer_next: false,
            delivered: HashMap::new(),
            rejected: HashMap::new(),
            suspects: BTreeSet::new(),
        }
    }

    /// EDS: Envoy rejected `responses` (the ones its answer settled), so what they carried
    /// was not applied and goes again: alone if it was alone (then it is the culprit and is
    /// not sent again in that form), each in its own response if there were several.
    fn eds_rejected(&mut self, responses: &[Unanswered<u64>]) {
        if responses.is_empty() {
            // Which response Envoy rejected is unknown: assume it holds nothing from us.
            self.delivered.clear();
            return;
        }
        let carried: BTreeSet<(&String, u64)> = responses
            .iter()
            .flat_map(|r| r.carried.iter().map(|(n, h)| (n, *h)))
            .collect();
        for (name, hash) in &carried {
            if self.delivered.get(*name) == Some(hash) {
                self.delivered.remove(*name);
            }
        }
        let mut names = carried.iter().map(|(n, h)| (*n, *h));
        match (names.next(), names.next()) {
            (Some((name, hash)), None) => {
                self.suspects.remove(name);
                self.rejected.insert(name.clone(), hash);
            }
            _ => self
                .suspects
                .extend(carried.iter().map(|(n, _)| (*n).clone())),
        }
    }

    /// EDS: Envoy accepted `responses`: what they carried is no longer suspect.
    fn eds_accepted(&mut self, responses: &[Unanswered<u64>]) {
        for (name, _) in responses.iter().flat_map(|r| &r.carried) {
            self.suspects.remove(name);
        }
    }

    /// EDS: the assignments to send for `current`, with their hashes: every subscribed one
    /// toolgate has when `full`, else those not delivered in their current form; never one
    /// Envoy rejected in its current form.
    /// Only `node`'s: a shard gets no other service's assignment.
    fn eds_wanted(
        &self,
        current: &TypeSnapshot,
        full: bool,
        node: &NodeView,
    ) -> Vec<(String, u64)> {
        let names: Vec<&String> = match &self.subscription {
            Subscription::Wildcard => current.names().collect(),
            Subscription::Names(names) => names.iter().collect(),
        };
        names
            .into_iter()
            .filter(|name| node.serves(ResourceType::Endpoint, name))
            .filter_map(|name| {
                let hash = current.hash(name)?;
                let wanted = self.rejected.get(name) != Some(&hash)
                    && (full || self.delivered.get(name) != Some(&hash));
                wanted.then(|| (name.clone(), hash))
            })
            .collect()
    }

    /// EDS: forgets what it knows of assignments this Envoy no longer subscribes to.
    fn eds_forget_unsubscribed(&mut self, current: &TypeSnapshot) {
        let subscription = &self.subscription;
        let keep = |name: &String| match subscription {
            Subscription::Wildcard => current.hash(name).is_some(),
            Subscription::Names(names) => names.contains(name),
        };
        self.delivered.retain(|n, _| keep(n));
        self.rejected.retain(|n, _| keep(n));
        self.suspects.retain(|n| keep(n));
    }
}

/// The state of the world protocol on one stream.
#[derive(Debug, Default)]
pub(super) struct Sotw {
    /// Only types the Envoy has asked for: nothing is pushed before it subscribes.
    types: BTreeMap<ResourceType, TypeState>,
}

impl Protocol for Sotw {
    type Request = DiscoveryRequest;
    type Response = DiscoveryResponse;
    /// EDS only: each assignment's content hash.
    type Carried = u64;
    const NAME: &'static str = "sotw";

    /// Every request carries the whole subscription; a stale one's is outdated and ignored.
    fn subscribe(&mut self, ty: ResourceType, request: &DiscoveryRequest, stale: bool) {
        let state = self.types.entry(ty).or_insert_with(|| TypeState::new(ty));
        if stale {
            debug!(r#type = ty.short_name(), nonce = %request.response_nonce,
                "stale request: its subscription is ignored");
        } else {
            state.subscription = Subscription::from_request(ty, &request.resource_names);
        }
    }

    fn accepted(&mut self, ty: ResourceType, answered: &[Unanswered<u64>]) {
        if let Some(state) = self.types.get_mut(&ty) {
            state.eds_accepted(answered);
        }
    }

    fn rejected(&mut self, ty: ResourceType, answered: &[Unanswered<u64>]) {
        let Some(state) = self.types.get_mut(&ty) else {
            return;
        };
        if ty == ResourceType::Endpoint {
            state.eds_rejected(answered);
        } else if let Some(response) = answered.last() {
            state.nacked = Some(response.version.clone());
        }
    }

    /// Answers the request if the Envoy lacks something.
    async fn answer(
        &mut self,
        envoy: &mut Envoy<Sotw>,
        ty: ResourceType,
        request: &DiscoveryRequest,
        stale: bool,
        view: Option<&CacheSnapshot>,
    ) -> Result<(), Closed> {
        let Some(current) = view.and_then(|v| v.get(ty)) else {
            // Not ready, or a type not built yet (ECDS): answered by the push that brings it.
            return Ok(());
        };
        let Some(state) = self.types.get(&ty) else {
            return Ok(());
        };
        let answer = if ty == ResourceType::Endpoint {
            // By assignment, not by version: a NACK (stale or not) may have taken back
            // assignments Envoy must get again, while a version it rejected must not be
            // resent just because Envoy still reports the one before.
            match &state.sent_for {
                None => !stale,
                Some(sent_for) => {
                    !state.eds_wanted(current, false, &envoy.node).is_empty()
                        || (!stale && (state.answer_next || !sent_for.covers(&state.subscription)))
                }
            }
        } else if stale || state.nacked.as_deref() == Some(current.version.as_str()) {
            false
        } else {
            match &state.sent_for {
                // Nothing sent on this stream yet: Envoy waits for a first answer.
                None => true,
                Some(sent_for) => {
                    request.version_info != current.version
                        || !sent_for.covers(&state.subscription)
                        || state.answer_next
                }
            }
        };
        if answer {
            let current = Arc::clone(current);
            self.send_owed(envoy, ty, &current).await?;
        }
        Ok(())
    }

    /// A new cache view: sends every type whose version this Envoy lacks, in push order (CDS,
    /// EDS, RDS). Types the Envoy never asked for are not pushed.
    async fn push(&mut self, envoy: &mut Envoy<Sotw>, view: &CacheSnapshot) -> Result<(), Closed> {
        for ty in ResourceType::ALL {
            let Some(state) = self.types.get(&ty) else {
                continue;
            };
            let Some(current) = view.get(ty) else {
                continue;
            };
            let lacks = match envoy.sent_version(ty) {
                None => true,
                Some(sent) if ty == ResourceType::Endpoint => {
                    sent != current.version
                        || state.answer_next
                        || !state.eds_wanted(current, false, &envoy.node).is_empty()
                }
                Some(_) if state.nacked.as_deref() == Some(current.version.as_str()) => false,
                Some(sent) => sent != current.version || state.answer_next,
            };
            if lacks {
                let current = Arc::clone(current);
                self.send_owed(envoy, ty, &current).await?;
            }
        }
        Ok(())
    }
}

impl Sotw {
    /// Sends `current` for the names this Envoy subscribed and records it. EDS sends only what
    /// this Envoy lacks (everything after CDS), in one response, except that each suspect of
    /// an earlier rejection goes in a response of its own.
    async fn send_owed(
        &mut self,
        envoy: &mut Envoy<Sotw>,
        ty: ResourceType,
        current: &Arc<TypeSnapshot>,
    ) -> Result<(), Closed> {
        if envoy.lacks_filter_path(ty) {
            return Ok(());
        }
        let Some(state) = self.types.get_mut(&ty) else {
            return Ok(());
        };
        if ty != ResourceType::Endpoint {
            let names: Vec<&String> = match &state.subscription {
                Subscription::Wildcard => current.names().collect(),
                Subscription::Names(names) => names.iter().collect(),
            };
            let mut resources = Vec::new();
            for name in names {
                if !envoy.node.serves(ty, name) {
                    continue;
                }
                let Some((any, hash)) = current.entry(name) else {
                    continue;
                };
                match envoy.tailor(ty, name, any, hash) {
                    Tailored::Made(made) => resources.push(made),
                    Tailored::AsIs => resources.push(any.clone()),
                    Tailored::Nothing => {}
                }
            }
            return self
                .send_response(envoy, ty, current, resources, Vec::new())
                .await;
        }
        // After CDS, re-created clusters warm until they get an assignment, changed or not:
        // then (and on a fresh stream, where `delivered` is empty) EDS goes out in full.
        let wanted = state.eds_wanted(current, state.answer_next, &envoy.node);
        state.eds_forget_unsubscribed(current);
        let (alone, together): (Vec<_>, Vec<_>) = wanted
            .into_iter()
            .partition(|(name, _)| state.suspects.contains(name));
        // The response with everything else goes also when empty: it answers the request and
        // carries the version.
        let mut responses = Vec::new();
        if !together.is_empty() || alone.is_empty() {
            responses.push(together);
        }
        responses.extend(alone.into_iter().map(|one| vec![one]));
        for carried in responses {
            let resources = current.select(carried.iter().map(|(name, _)| name));
            self.send_response(envoy, ty, current, resources, carried)
                .await?;
        }
        Ok(())
    }

    /// Sends one response of `current`'s version with `resources` and records it; `carried`
    /// names (EDS) the assignments among them, with their hashes.
    async fn send_response(
        &mut self,
        envoy: &mut Envoy<Sotw>,
        ty: ResourceType,
        current: &Arc<TypeSnapshot>,
        resources: Vec<Any>,
        carried: Vec<(String, u64)>,
    ) -> Result<(), Closed> {
        let Some(state) = self.types.get_mut(&ty) else {
            return Ok(());
        };
        let nonce = envoy.next_nonce();
        let count = resources.len();
        let response = DiscoveryResponse {
            version_info: current.version.clone(),
            resources,
            type_url: ty.type_url().to_string(),
            nonce: nonce.to_string(),
            control_plane: control_plane(),
            ..Default::default()
        };
        state.sent_for = Some(state.subscription.clone());
        for (name, hash) in &carried {
            state.delivered.insert(name.clone(), *hash);
        }
        state.answer_next = false;
        if ty == ResourceType::Cluster {
            if let Some(eds) = self.types.get_mut(&ResourceType::Endpoint) {
                eds.answer_next = true;
            }
        }
        envoy
            .send(ty, current, nonce, response, carried, count)
            .await?;
        debug!(node = %envoy.node, r#type = ty.short_name(), version = %current.version,
            %nonce, resources = count, "xDS response sent");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::xds::stream::tests::routing;
    use envoy_types::pb::envoy::config::core::v3::Node;
    use envoy_types::pb::google::rpc::Status as RpcStatus;

    const CDS: ResourceType = ResourceType::Cluster;
    const EDS: ResourceType = ResourceType::Endpoint;
    const RDS: ResourceType = ResourceType::Route;

    /// A state of the world stream under test.
    type Harness = crate::xds::stream::tests::Harness<Sotw>;

    fn request(ty: ResourceType, names: &[&str], version: &str, nonce: &str) -> DiscoveryRequest {
        DiscoveryRequest {
            version_info: version.into(),
            node: Some(Node {
                id: "envoy-1".into(),
                ..Default::default()
            }),
            resource_names: names.iter().map(|n| n.to_string()).collect(),
            type_url: ty.type_url().into(),
            response_nonce: nonce.into(),
            ..Default::default()
        }
    }

    /// The ACK of `response`, keeping the subscription `names`.
    fn ack(response: &DiscoveryResponse, names: &[&str]) -> DiscoveryRequest {
        let ty = ResourceType::from_type_url(&response.type_url).expect("known type");
        request(ty, names, &response.version_info, &response.nonce)
    }

    fn nack(response: &DiscoveryResponse, names: &[&str], kept: &str) -> DiscoveryRequest {
        let ty = ResourceType::from_type_url(&response.type_url).expect("known type");
        DiscoveryRequest {
            error_detail: Some(RpcStatus {
                code: 3,
                message: "bad cluster".into(),
                details: Vec::new(),
            }),
            ..request(ty, names, kept, &response.nonce)
        }
    }

    fn resource_count(r: &DiscoveryResponse) -> usize {
        r.resources.len()
    }

    #[tokio::test]
    async fn first_request_is_answered_and_its_ack_is_not() {
        let mut h = Harness::new();
        h.publish(routing(1, &[("a", &[1])])).await;
        assert!(
            h.sent().is_empty(),
            "nothing pushed before Envoy subscribes"
        );

        h.request(request(CDS, &[], "", "")).await;
        let sent = h.sent();
        assert_eq!(sent.len(), 1);
        assert_eq!(sent[0].type_url, CDS.type_url());
        assert_eq!(resource_count(&sent[0]), 1);
        assert_eq!(h.stream.envoy.node.id, "envoy-1");

        h.request(ack(&sent[0], &[])).await;
        assert!(
            h.sent().is_empty(),
            "an ACK of the current version needs no answer"
        );
    }

    #[tokio::test]
    async fn requests_before_the_first_snapshot_are_answered_when_it_arrives() {
        let mut h = Harness::new();
        h.request(request(CDS, &[], "", "")).await;
        assert!(h.sent().is_empty(), "nothing to serve yet");
        h.publish(routing(1, &[("a", &[1])])).await;
        let sent = h.sent();
        assert_eq!(sent.len(), 1);
        assert_eq!(sent[0].type_url, CDS.type_url());
    }

    #[tokio::test]
    async fn a_stale_nonce_is_ignored() {
        let mut h = Harness::new();
        h.publish(routing(1, &[("a", &[1])])).await;
        h.request(request(EDS, &["mcp.a"], "", "")).await;
        let first = h.sent().remove(0);
        h.publish(routing(2, &[("a", &[1, 2])])).await;
        let second = h.sent().remove(0);
        assert_ne!(first.version_info, second.version_info);
        // Written before Envoy saw `second`: asks for a new name, but is stale.
        h.request(request(EDS, &["mcp.a", "mcp.b"], "", &first.nonce))
            .await;
        assert!(h.sent().is_empty());
    }

    #[tokio::test]
    async fn a_nacked_version_is_never_sent_again_but_the_next_one_is() {
        let mut h = Harness::new();
        h.publish(routing(1, &[("a", &[1])])).await;
        h.request(request(CDS, &[], "", "")).await;
        let v1 = h.sent().remove(0);
        h.request(ack(&v1, &[])).await;
        h.publish(routing(2, &[("a", &[1]), ("b", &[])])).await;
        let v2 = h.sent().remove(0);
        assert_eq!(v2.type_url, CDS.type_url());

        h.request(nack(&v2, &[], &v1.version_info)).await;
        assert_eq!(h.nacks(CDS), 1);
        assert!(h.sent().is_empty(), "the rejected version is not resent");
        // The same content under a new generation is the same version: still not resent.
        h.publish(routing(3, &[("a", &[1]), ("b", &[])])).await;
        assert!(h.sent().is_empty());
        // Envoy asks again (e.g. after another type's update): still not resent.
        h.request(request(CDS, &[], &v1.version_info, &v2.nonce))
            .await;
        assert!(h.sent().is_empty());

        h.publish(routing(4, &[("a", &[1]), ("c", &[])])).await;
        let v3 = h.sent().remove(0);
        assert_eq!(v3.type_url, CDS.type_url());
        assert_ne!(v3.version_info, v2.version_info);
    }

    #[tokio::test]
    async fn new_names_are_answered_at_once_even_if_the_version_is_unchanged() {
        let mut h = Harness::new();
        h.publish(routing(1, &[("a", &[1]), ("b", &[2])])).await;
        h.request(request(EDS, &["mcp.a"], "", "")).await;
        let r = h.sent().remove(0);
        assert_eq!(resource_count(&r), 1);
        // A cluster started warming: its name joins the subscription.
        h.request(request(EDS, &["mcp.a", "mcp.b"], &r.version_info, &r.nonce))
            .await;
        let r2 = h.sent().remove(0);
        assert_eq!(r2.version_info, r.version_info);
        assert_eq!(
            resource_count(&r2),
            1,
            "only the new name; mcp.a was delivered"
        );
        // A name toolgate does not know is answered once (without it), not on every ACK.
        h.request(request(
            EDS,
            &["mcp.a", "mcp.b", "mcp.x"],
            &r2.version_info,
            &r2.nonce,
        ))
        .await;
        let r3 = h.sent().remove(0);
        assert_eq!(resource_count(&r3), 0, "nothing this stream lacks");
        h.request(ack(&r3, &["mcp.a", "mcp.b", "mcp.x"])).await;
        assert!(h.sent().is_empty());
        // Fewer names need no answer.
        h.request(ack(&r3, &["mcp.a"])).await;
        assert!(h.sent().is_empty());
    }

    /// The EDS responses among `sent`, each as the names it carried.
    fn eds_names(sent: &[DiscoveryResponse]) -> Vec<Vec<String>> {
        use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
        use prost::Message;
        sent.iter()
            .filter(|r| r.type_url == EDS.type_url())
            .map(|r| {
                r.resources
                    .iter()
                    .map(|a| {
                        ClusterLoadAssignment::decode(a.value.as_slice())
                            .expect("an assignment")
                            .cluster_name
                    })
                    .collect()
            })
            .collect()
    }

    const ABC: &[&str] = &["mcp.a", "mcp.b", "mcp.c"];

    #[tokio::test]
    async fn an_eds_push_carries_only_the_assignments_that_changed_and_a_rejected_one_stays_out() {
        let mut h = Harness::new();
        h.publish(routing(1, &[("a", &[1]), ("b", &[2]), ("c", &[3])]))
            .await;
        h.request(request(EDS, ABC, "", "")).await;
        let r = h.sent().remove(0);
        assert_eq!(resource_count(&r), 3, "a fresh stream gets everything");
        h.request(ack(&r, ABC)).await;
        h.publish(routing(2, &[("a", &[1]), ("b", &[2, 4]), ("c", &[3])]))
            .await;
        let pushed = h.sent();
        assert_eq!(eds_names(&pushed), [vec!["mcp.b"]], "only mcp.b changed");
        // Envoy rejects it: b alone was in it, so b in that form is not sent again, and a and
        // c, which Envoy holds, are not either.
        h.request(nack(&pushed[0], ABC, &r.version_info)).await;
        assert_eq!(h.nacks(EDS), 1);
        assert!(h.sent().is_empty(), "the rejected assignment is not resent");
        // Envoy asks again, still reporting the version before: nothing to send.
        h.request(request(EDS, ABC, &r.version_info, &pushed[0].nonce))
            .await;
        assert!(h.sent().is_empty());
        // b's next form goes out as usual, still alone.
        h.publish(routing(3, &[("a", &[1]), ("b", &[2, 5]), ("c", &[3])]))
            .await;
        assert_eq!(eds_names(&h.sent()), [vec!["mcp.b"]]);
    }

    #[tokio::test]
    async fn a_shard_gets_the_control_assignment_and_a_member_change_sends_only_it() {
        use crate::routing::ControlMembers;
        use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};
        const CONTROL: &str = toolgate_model::envoy::CONTROL_CLUSTER;
        let members = |peers: &[&str]| {
            Arc::new(ControlMembers {
                local: Some("127.0.0.1:19000".parse().expect("addr")),
                peers: peers.iter().map(|p| p.parse().expect("addr")).collect(),
            })
        };
        let mut h = Harness::new();
        let mut snap = routing(1, &[("a", &[1]), ("b", &[2])]);
        snap.control = members(&[]);
        h.publish(snap.clone()).await;
        // An Envoy that serves service `a` only.
        let services = Value {
            kind: Some(Kind::ListValue(ListValue {
                values: vec![Value {
                    kind: Some(Kind::StringValue("a".into())),
                }],
            })),
        };
        let toolgate = Struct {
            fields: [(
                super::super::shard::NODE_SERVICES_FIELD.to_string(),
                services,
            )]
            .into(),
        };
        let metadata = Struct {
            fields: [(
                super::super::ecds::NODE_METADATA_KEY.to_string(),
                Value {
                    kind: Some(Kind::StructValue(toolgate)),
                },
            )]
            .into(),
        };
        let names = ["mcp.a", "mcp.b", CONTROL];
        let mut first = request(EDS, &names, "", "");
        if let Some(node) = first.node.as_mut() {
            node.metadata = Some(metadata);
        }
        h.request(first).await;
        let r = h.sent().remove(0);
        assert_eq!(
            eds_names(std::slice::from_ref(&r)),
            [vec!["mcp.a", CONTROL]]
        );
        h.request(ack(&r, &names)).await;
        // A second toolgate-xds joins the fleet: only the control assignment goes.
        snap.generation = 2;
        snap.control = members(&["127.0.0.2:19000"]);
        h.publish(snap).await;
        assert_eq!(eds_names(&h.sent()), [vec![CONTROL]]);
    }

    #[tokio::test]
    async fn a_rejected_eds_response_with_several_assignments_goes_again_one_by_one() {
        let mut h = Harness::new();
        h.publish(routing(1, &[("a", &[1]), ("b", &[2]), ("c", &[3])]))
            .await;
        h.request(request(CDS, &[], "", "")).await;
        let cds = h.sent().remove(0);
        h.request(ack(&cds, &[])).await;
        h.request(request(EDS, ABC, "", "")).await;
        let r = h.sent().remove(0);
        h.request(ack(&r, ABC)).await;
        let two = || routing(2, &[("a", &[1, 4]), ("b", &[2, 5]), ("c", &[3])]);
        h.publish(two()).await;
        let both = h.sent().remove(0);
        assert_eq!(
            eds_names(std::slice::from_ref(&both)),
            [vec!["mcp.a", "mcp.b"]]
        );
        // Envoy applied none of it: a and b go again, each alone, so the invalid one cannot
        // hold back the other.
        h.request(nack(&both, ABC, &r.version_info)).await;
        let again = h.sent();
        assert_eq!(eds_names(&again), [vec!["mcp.a"], vec!["mcp.b"]]);
        // Envoy reads both before answering: its ACK of the first names an older response.
        h.request(ack(&again[0], ABC)).await;
        h.request(nack(&again[1], ABC, &again[0].version_info))
            .await;
        assert_eq!(h.nacks(EDS), 2);
        assert!(
            h.sent().is_empty(),
            "b in that form is the culprit: not resent"
        );
        // A CDS change re-creates clusters: each gets its assignment again, except the
        // rejected one, although the EDS version did not change.
        let mut limited = two();
        limited.generation = 3;
        if let Some(a) = limited.services.get_mut("a") {
            Arc::make_mut(a).limits.max_connections = 7;
        }
        h.publish(limited).await;
        let sent = h.sent();
        assert_eq!(sent.len(), 2, "CDS, then EDS for the warming clusters");
        assert_eq!(eds_names(&sent), [vec!["mcp.a", "mcp.c"]]);
    }

    #[tokio::test]
    async fn a_nack_that_names_an_older_response_is_counted_and_what_it_carried_goes_again() {
        let mut h = Harness::new();
        h.publish(routing(1, &[("a", &[1]), ("b", &[2]), ("c", &[3])]))
            .await;
        h.request(request(EDS, ABC, "", "")).await;
        let r = h.sent().remove(0);
        h.request(ack(&r, ABC)).await;
        h.publish(routing(2, &[("a", &[1, 4]), ("b", &[2, 5]), ("c", &[3])]))
            .await;
        let n = h.sent().remove(0);
        h.publish(routing(
            3,
            &[("a", &[1, 4]), ("b", &[2, 5]), ("c", &[3, 6])],
        ))
        .await;
        let n1 = h.sent().remove(0);
        assert_eq!(eds_names(std::slice::from_ref(&n1)), [vec!["mcp.c"]]);
        // Envoy rejects N after N+1 went out: counted against N's version, and what N carried
        // goes again (each alone), although N+1 is what Envoy will hold.
        h.request(nack(&n, ABC, &r.version_info)).await;
        assert_eq!(h.nacks(EDS), 1);
        assert_eq!(eds_names(&h.sent()), [vec!["mcp.a"], vec!["mcp.b"]]);
        // The subscription of a stale request is outdated, though: a name it adds is not
        // answered (the request answering the latest response will say what Envoy wants).
        h.request(ack(&n1, &["mcp.a", "mcp.b", "mcp.c", "mcp.d"]))
            .await;
        assert!(h.sent().is_empty());
    }

    #[tokio::test]
    async fn changes_are_pushed_cds_eds_rds_and_eds_follows_every_cds() {
        let mut h = Harness::new();
        h.publish(routing(1, &[("a", &[1])])).await;
        h.request(request(CDS, &[], "", "")).await;
        h.request(request(EDS, &["mcp.a"], "", "")).await;
        h.request(request(RDS, &["toolgate_routes"], "", "")).await;
        let initial = h.sent();
        assert_eq!(initial.len(), 3);
        let last: Vec<DiscoveryRequest> = initial
            .iter()
            .zip([&[][..], &["mcp.a"][..], &["toolgate_routes"][..]])
            .map(|(r, names)| ack(r, names))
            .collect();
        for a in last {
            h.request(a).await;
        }
        assert!(h.sent().is_empty());

        // A new service changes all three: pushed in order.
        h.publish(routing(2, &[("a", &[1]), ("b", &[2])])).await;
        let pushed: Vec<String> = h.sent().into_iter().map(|r| r.type_url).collect();
        assert_eq!(pushed, [CDS.type_url(), EDS.type_url(), RDS.type_url()]);

        // Only an endpoint changes: EDS alone.
        h.publish(routing(3, &[("a", &[1, 3]), ("b", &[2])])).await;
        let pushed: Vec<String> = h.sent().into_iter().map(|r| r.type_url).collect();
        assert_eq!(pushed, [EDS.type_url()]);

        // Only the limits change (CDS): EDS is sent too, unchanged, because Envoy re-creates
        // the cluster and it warms until it gets an assignment.
        let limited = |generation| {
            let mut r = routing(generation, &[("a", &[1, 3]), ("b", &[2])]);
            if let Some(a) = r.services.get_mut("a") {
                Arc::make_mut(a).limits.max_connections = 7;
            }
            r
        };
        let eds_before = h.view().and_then(|v| v.version(EDS).map(str::to_string));
        h.publish(limited(4)).await;
        let pushed = h.sent();
        let types: Vec<&str> = pushed.iter().map(|r| r.type_url.as_str()).collect();
        assert_eq!(types, [CDS.type_url(), EDS.type_url()]);
        assert_eq!(Some(pushed[1].version_info.clone()), eds_before);

        // Nothing changed: nothing sent.
        h.publish(limited(5)).await;
        assert!(h.sent().is_empty());
    }

    fn names(n: &[&str]) -> Vec<String> {
        n.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn empty_names_are_a_wildcard_only_for_cds() {
        assert_eq!(
            Subscription::from_request(ResourceType::Cluster, &[]),
            Subscription::Wildcard
        );
        assert_eq!(
            Subscription::from_request(ResourceType::Endpoint, &[]),
            Subscription::Names(BTreeSet::new())
        );
        assert_eq!(
            Subscription::from_request(ResourceType::Endpoint, &names(&["*"])),
            Subscription::Wildcard
        );
    }

    #[test]
    fn a_new_name_is_not_covered_by_the_last_response() {
        let sent = Subscription::from_request(ResourceType::Endpoint, &names(&["mcp.a"]));
        let same = Subscription::from_request(ResourceType::Endpoint, &names(&["mcp.a"]));
        let fewer = Subscription::from_request(ResourceType::Endpoint, &[]);
        let more = Subscription::from_request(ResourceType::Endpoint, &names(&["mcp.a", "mcp.b"]));
        assert!(sent.covers(&same));
        assert!(sent.covers(&fewer));
        assert!(!sent.covers(&more));
        assert!(Subscription::Wildcard.covers(&more));
        assert!(!sent.covers(&Subscription::Wildcard));
    }
}
