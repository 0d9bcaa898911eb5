//! The incremental protocol's tests, each on one stream fed by a cache.

use super::*;

#[test]
fn a_version_is_recognized_without_formatting() {
    for hash in [0, 1, 0xdead_beef, u64::MAX, 0x0123_4567_89ab_cdef] {
        assert!(is_version(&version_of(hash), hash), "{hash:x}");
        assert!(!is_version(&version_of(hash ^ 1), hash), "{hash:x}");
    }
    assert!(!is_version("", 0));
    assert!(!is_version("00000000000000000", 0));
    assert!(!is_version("000000000000000é", 0));
}
use crate::routing::RoutingSnapshot;
use crate::xds::stream::tests::routing;
use crate::xds::stream::tests::Harness as StreamHarness;
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryResponse;
use envoy_types::pb::google::rpc::Status as RpcStatus;

const CDS: ResourceType = ResourceType::Cluster;
const EDS: ResourceType = ResourceType::Endpoint;
const RDS: ResourceType = ResourceType::Route;
const ECDS: ResourceType = ResourceType::ExtensionConfig;

/// A delta stream under test.
type Harness = StreamHarness<Delta>;

impl StreamHarness<Delta> {
    /// Sends `request` and ACKs every response it draws, as Envoy does.
    async fn request_and_ack(
        &mut self,
        request: DeltaDiscoveryRequest,
    ) -> Vec<DeltaDiscoveryResponse> {
        self.request(request).await;
        let sent = self.sent();
        for r in &sent {
            self.request(ack(r)).await;
        }
        sent
    }
}

/// An Envoy whose bootstrap names the filter, so that it is served ECDS.
fn node() -> Node {
    use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
    let string = |s: &str| Value {
        kind: Some(Kind::StringValue(s.to_string())),
    };
    let toolgate = Struct {
        fields: [(
            crate::xds::ecds::NODE_FILTER_PATH_FIELD.to_string(),
            string("/filter.wasm"),
        )]
        .into(),
    };
    Node {
        id: "envoy-1".into(),
        metadata: Some(Struct {
            fields: [(
                crate::xds::ecds::NODE_METADATA_KEY.to_string(),
                Value {
                    kind: Some(Kind::StructValue(toolgate)),
                },
            )]
            .into(),
        }),
        ..Default::default()
    }
}

fn subscribe(ty: ResourceType, names: &[&str]) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        node: Some(node()),
        type_url: ty.type_url().into(),
        resource_names_subscribe: names.iter().map(|n| n.to_string()).collect(),
        ..Default::default()
    }
}

fn ack(response: &DeltaDiscoveryResponse) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        type_url: response.type_url.clone(),
        response_nonce: response.nonce.clone(),
        ..Default::default()
    }
}

fn nack(response: &DeltaDiscoveryResponse) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        error_detail: Some(RpcStatus {
            code: 3,
            message: "bad resource".into(),
            details: Vec::new(),
        }),
        ..ack(response)
    }
}

fn names(r: &DeltaDiscoveryResponse) -> Vec<&str> {
    r.resources.iter().map(|r| r.name.as_str()).collect()
}

fn of(ty: ResourceType, r: &DeltaDiscoveryResponse) -> bool {
    r.type_url == ty.type_url()
}

/// A harness whose Envoy subscribed CDS (wildcard), EDS for `services` and the routes,
/// every response acknowledged.
async fn subscribed(services: &[(&str, &[u8])]) -> Harness {
    let mut h = Harness::new();
    h.publish(routing(1, services)).await;
    let cds = h.request_and_ack(subscribe(CDS, &[])).await;
    assert_eq!(cds.len(), 1);
    assert_eq!(cds[0].resources.len(), services.len());
    let clusters: Vec<String> = services.iter().map(|(s, _)| format!("mcp.{s}")).collect();
    let clusters: Vec<&str> = clusters.iter().map(String::as_str).collect();
    let eds = h.request_and_ack(subscribe(EDS, &clusters)).await;
    assert_eq!(names(&eds[0]), clusters);
    // The table an Envoy with the filter asks for (its bootstrap names it).
    let rds = h
        .request_and_ack(subscribe(
            RDS,
            &[crate::xds::resources::SHARED_ROUTE_CONFIG_NAME],
        ))
        .await;
    assert_eq!(rds.len(), 1);
    h
}

#[tokio::test]
async fn the_control_assignment_is_sent_once_and_again_only_when_the_members_change() {
    use crate::routing::ControlMembers;
    const CONTROL: &str = toolgate_model::envoy::CONTROL_CLUSTER;
    let members = |peers: &[&str]| {
        Arc::new(ControlMembers {
            local: Some("127.0.0.1:19000".parse().expect("addr")),
            peers: peers.iter().map(|p| p.parse().expect("addr")).collect(),
        })
    };
    let mut h = subscribed(&[("a", &[1])]).await;
    // The bootstrap's static cluster asks for its assignment by name.
    let sent = h.request_and_ack(subscribe(EDS, &[CONTROL])).await;
    assert_eq!(sent.iter().map(names).collect::<Vec<_>>(), [vec![CONTROL]]);
    // An instance change: not the control assignment.
    h.publish(routing(2, &[("a", &[1, 2])])).await;
    let sent = h.sent();
    assert_eq!(sent.iter().map(names).collect::<Vec<_>>(), [vec!["mcp.a"]]);
    for r in &sent {
        h.request(ack(r)).await;
    }
    // Another toolgate-xds joins: the control assignment alone.
    let mut snap = routing(3, &[("a", &[1, 2])]);
    snap.control = members(&["127.0.0.2:19000"]);
    h.publish(snap).await;
    let sent = h.sent();
    assert_eq!(sent.iter().map(names).collect::<Vec<_>>(), [vec![CONTROL]]);
}

#[tokio::test]
async fn a_new_service_sends_its_cluster_and_its_assignment_and_routes_only_of_its_own() {
    let mut h = subscribed(&[("a", &[1]), ("b", &[2])]).await;
    let summary = |sent: &[DeltaDiscoveryResponse]| -> Vec<(&str, Vec<String>, Vec<String>)> {
        sent.iter()
            .map(|r| {
                (
                    ResourceType::from_type_url(&r.type_url)
                        .expect("known")
                        .short_name(),
                    names(r).into_iter().map(String::from).collect(),
                    r.removed_resources.clone(),
                )
            })
            .collect()
    };
    // The default path and timeout: the shared routes take it, no route changes.
    h.publish(routing(2, &[("a", &[1]), ("b", &[2]), ("c", &[3])]))
        .await;
    let sent = h.sent();
    assert_eq!(summary(&sent), [("cds", vec!["mcp.c".to_string()], vec![])]);
    // Envoy subscribes to the new cluster's assignment when it creates the cluster.
    for r in &sent {
        h.request(ack(r)).await;
    }
    let eds = h.request_and_ack(subscribe(EDS, &["mcp.c"])).await;
    assert_eq!(eds.len(), 1);
    assert_eq!(names(&eds[0]), ["mcp.c"]);
    // The same content again sends nothing.
    h.publish(routing(3, &[("a", &[1]), ("b", &[2]), ("c", &[3])]))
        .await;
    assert!(h.sent().is_empty());
    // A path of its own needs routes of its own: the route configuration goes too.
    let four = [
        ("a", &[1u8][..]),
        ("b", &[2][..]),
        ("c", &[3][..]),
        ("d", &[4][..]),
    ];
    h.publish(own_path(routing(4, &four), "d")).await;
    let sent = summary(&h.sent());
    assert_eq!(sent.len(), 2, "{sent:?}");
    assert_eq!(sent[0], ("cds", vec!["mcp.d".to_string()], vec![]));
    assert_eq!(sent[1].0, "rds", "{sent:?}");
}

/// `service` serves MCP at a path of its own, so it has routes of its own.
fn own_path(mut snapshot: RoutingSnapshot, service: &str) -> RoutingSnapshot {
    if let Some(route) = snapshot.services.get_mut(service) {
        Arc::make_mut(route).mcp_path = "/rpc".into();
    }
    snapshot
}

/// `json` as the filter configuration, with its urgency as the registry makes it: the
/// digest of all but what changes with services (0 when that is empty, as in
/// [`routing`]).
fn with_filter_config(mut snapshot: RoutingSnapshot, json: &str) -> RoutingSnapshot {
    let mut rest: serde_json::Map<String, serde_json::Value> = serde_json::from_str(json).unwrap();
    for services_part in ["catalog", "virtual_servers", "legacy_revisions"] {
        rest.remove(services_part);
    }
    snapshot.filter_urgency = if rest.is_empty() {
        0
    } else {
        std::hash::BuildHasher::hash_one(
            &std::hash::BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default(),
            serde_json::Value::Object(rest).to_string(),
        )
    };
    snapshot.filter_config = Arc::from(json);
    snapshot
}

fn types(sent: &[DeltaDiscoveryResponse]) -> Vec<&'static str> {
    sent.iter()
        .map(|r| {
            ResourceType::from_type_url(&r.type_url)
                .expect("known")
                .short_name()
        })
        .collect()
}

#[tokio::test]
async fn the_filter_configuration_goes_once_envoy_answered_the_clusters_and_routes_it_came_with() {
    let mut h = subscribed(&[("a", &[1])]).await;
    let name = crate::xds::ecds::FILTER_CONFIG_NAME;
    let first = h.request_and_ack(subscribe(ECDS, &[name])).await;
    assert_eq!(types(&first), ["ecds"]);

    // A new service whose tools change the configuration (its catalog): clusters and
    // routes first (a path of its own: routes of its own).
    let two = [("a", &[1u8][..]), ("b", &[2][..])];
    h.publish(with_filter_config(
        own_path(routing(2, &two), "b"),
        r#"{"catalog":{"b":[]}}"#,
    ))
    .await;
    let sent = h.sent();
    assert_eq!(types(&sent), ["cds", "rds"]);
    // An answer to an earlier configuration, or a route ACK alone, does not release it.
    h.request(ack(&first[0])).await;
    h.request(ack(&sent[1])).await;
    assert!(h.sent().is_empty());

    // Another new service meanwhile: its clusters and routes go, the configuration still
    // waits for the first ones only, and then goes in its latest form.
    let three = [("a", &[1u8][..]), ("b", &[2][..]), ("c", &[3][..])];
    h.publish(with_filter_config(
        own_path(own_path(routing(3, &three), "b"), "c"),
        r#"{"catalog":{"c":[]}}"#,
    ))
    .await;
    let later = h.sent();
    assert_eq!(types(&later), ["cds", "rds"]);
    h.request(ack(&sent[0])).await;
    let released = h.sent();
    assert_eq!(types(&released), ["ecds"], "{released:?}");
    let json = crate::xds::ecds::tests::plugin_json(
        released[0].resources[0]
            .resource
            .as_ref()
            .expect("a resource"),
    );
    assert!(json.contains(r#""c":[]"#), "{json}");

    // A catalog change alone does not wait for the later clusters and routes, only for
    // Envoy's answer to the configuration before it (each is applied whole, one after
    // another: a row of them would delay whatever comes next).
    h.publish(with_filter_config(
        own_path(own_path(routing(4, &three), "b"), "c"),
        r#"{"catalog":{"d":[]}}"#,
    ))
    .await;
    assert!(h.sent().is_empty());
    h.request(ack(&released[0])).await;
    let alone = h.sent();
    assert_eq!(types(&alone), ["ecds"]);

    // A new service that shares the routes: its cluster alone, and the configuration once
    // Envoy answered that.
    for r in later.iter().chain(&released).chain(&alone) {
        h.request(ack(r)).await;
    }
    let five = [
        ("a", &[1u8][..]),
        ("b", &[2][..]),
        ("c", &[3][..]),
        ("e", &[5][..]),
    ];
    h.publish(with_filter_config(
        own_path(own_path(routing(5, &five), "b"), "c"),
        r#"{"catalog":{"e":[]}}"#,
    ))
    .await;
    let sent = h.sent();
    assert_eq!(types(&sent), ["cds"]);
    h.request(ack(&sent[0])).await;
    assert_eq!(types(&h.sent()), ["ecds"]);
}

#[tokio::test]
async fn a_filter_configuration_the_filter_would_refuse_is_never_sent() {
    // A tool's open time above the default ceiling, which no service policy raises.
    const REFUSED: &str = r#"{"services":{"a":{"tools":{"t":{"open_ms":400000}}}}}"#;
    let name = crate::xds::ecds::FILTER_CONFIG_NAME;
    // Refused from the first: nothing goes, and Envoy keeps what it has (or waits).
    let mut h = subscribed(&[("a", &[1])]).await;
    h.publish(with_filter_config(routing(2, &[("a", &[1])]), REFUSED))
        .await;
    assert!(h
        .request_and_ack(subscribe(ECDS, &[name]))
        .await
        .iter()
        .all(|r| r.resources.is_empty()));
    assert_eq!(h.metrics.filter_config_invalid.get(), 1);

    let mut h = subscribed(&[("a", &[1])]).await;
    let good =
        r#"{"services":{"a":{"policy":{"max_open_ms":600000},"tools":{"t":{"open_ms":400000}}}}}"#;
    h.publish(with_filter_config(routing(2, &[("a", &[1])]), good))
        .await;
    let first = h.request_and_ack(subscribe(ECDS, &[name])).await;
    assert_eq!(types(&first), ["ecds"]);
    let held = first[0].resources[0].version.clone();
    // The service's policy goes: what comes out would be refused, so nothing is sent,
    // once, however often it is published.
    for generation in 3..6 {
        h.publish(with_filter_config(
            routing(generation, &[("a", &[1])]),
            REFUSED,
        ))
        .await;
        assert!(h.sent().is_empty(), "generation {generation}");
    }
    assert_eq!(h.metrics.filter_config_invalid.get(), 1, "counted once");
    // A resubscription gets the last good one, not the refused one.
    let again = h.request_and_ack(subscribe(ECDS, &[name])).await;
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].resources[0].version, held);
    // A good configuration goes again.
    h.publish(with_filter_config(routing(6, &[("a", &[1])]), r#"{"x":2}"#))
        .await;
    let sent = h.sent();
    assert_eq!(types(&sent), ["ecds"]);
    assert_ne!(sent[0].resources[0].version, held);
}

#[tokio::test]
async fn an_operators_change_goes_at_once_beside_new_clusters_and_takes_a_held_one_along() {
    const OVERRIDE: &str = r#""overrides":{"a":{"t":{"mode":"force_open","reason":"r"}}}"#;
    let mut h = subscribed(&[("a", &[1])]).await;
    let name = crate::xds::ecds::FILTER_CONFIG_NAME;
    h.request_and_ack(subscribe(ECDS, &[name])).await;

    // A new service and an override in one push: the override does not wait for Envoy to
    // answer the cluster and routes (the catalog goes with it, whole).
    let two = [("a", &[1u8][..]), ("b", &[2][..])];
    h.publish(with_filter_config(
        own_path(routing(2, &two), "b"),
        &format!(r#"{{"catalog":{{"b":[]}},{OVERRIDE}}}"#),
    ))
    .await;
    let sent = h.sent();
    assert_eq!(types(&sent), ["cds", "rds", "ecds"]);
    for r in &sent {
        h.request(ack(r)).await;
    }

    // Another new service alone: its configuration waits for Envoy's answer...
    let three = [("a", &[1u8][..]), ("b", &[2][..]), ("c", &[3][..])];
    h.publish(with_filter_config(
        own_path(own_path(routing(3, &three), "b"), "c"),
        &format!(r#"{{"catalog":{{"b":[],"c":[]}},{OVERRIDE}}}"#),
    ))
    .await;
    let routing_sent = h.sent();
    assert_eq!(types(&routing_sent), ["cds", "rds"]);
    // ...until an operator's change comes: it goes at once, with the held catalog.
    h.publish(with_filter_config(
        own_path(own_path(routing(4, &three), "b"), "c"),
        r#"{"catalog":{"b":[],"c":[]}}"#,
    ))
    .await;
    let sent = h.sent();
    assert_eq!(
        types(&sent),
        ["ecds"],
        "the CDS and RDS are still unanswered"
    );
    let json = crate::xds::ecds::tests::plugin_json(
        sent[0].resources[0].resource.as_ref().expect("a resource"),
    );
    assert!(
        json.contains(r#""c":[]"#) && !json.contains("overrides"),
        "{json}"
    );
    // The answers to the routing release nothing more: nothing is owed.
    for r in &routing_sent {
        h.request(ack(r)).await;
    }
    assert!(h.sent().is_empty());
}

#[tokio::test]
async fn a_rejected_route_configuration_releases_the_filter_configuration_too() {
    let mut h = subscribed(&[("a", &[1])]).await;
    let name = crate::xds::ecds::FILTER_CONFIG_NAME;
    h.request_and_ack(subscribe(ECDS, &[name])).await;
    let mut snapshot = with_filter_config(routing(2, &[("a", &[1])]), r#"{"catalog":{"a":["x"]}}"#);
    let mut a = crate::routing::ServiceRoute::clone(&snapshot.services["a"]);
    a.timeout_ms = 5_000;
    snapshot.services.insert("a".to_string(), Arc::new(a));
    h.publish(snapshot).await;
    let sent = h.sent();
    assert_eq!(types(&sent), ["rds"]);
    h.request(nack(&sent[0])).await;
    assert_eq!(types(&h.sent()), ["ecds"]);
}

#[tokio::test]
async fn an_endpoint_change_sends_one_assignment_and_a_changed_cluster_its_assignment_too() {
    let mut h = subscribed(&[("a", &[1]), ("b", &[2])]).await;
    h.publish(routing(2, &[("a", &[1, 9]), ("b", &[2])])).await;
    let sent = h.sent();
    assert_eq!(sent.len(), 1);
    assert!(of(EDS, &sent[0]));
    assert_eq!(names(&sent[0]), ["mcp.a"]);
    h.request(ack(&sent[0])).await;

    // A cluster change (another connection limit) re-creates the cluster in Envoy: its assignment
    // goes again, unchanged, or the cluster would warm until Envoy's fetch timeout.
    let mut changed = routing(3, &[("a", &[1, 9]), ("b", &[2])]);
    if let Some(b) = changed.services.get_mut("b") {
        Arc::make_mut(b).limits.max_connections = 65;
    }
    h.publish(changed).await;
    let sent = h.sent();
    let cds: Vec<_> = sent.iter().filter(|r| of(CDS, r)).collect();
    let eds: Vec<_> = sent.iter().filter(|r| of(EDS, r)).collect();
    assert_eq!(cds.len(), 1);
    assert_eq!(names(cds[0]), ["mcp.b"]);
    assert_eq!(eds.len(), 1);
    assert_eq!(names(eds[0]), ["mcp.b"]);
}

#[tokio::test]
async fn a_cluster_resent_in_answer_to_a_request_brings_its_assignment_along() {
    let mut h = subscribed(&[("a", &[1]), ("b", &[2])]).await;
    let mut changed = routing(2, &[("a", &[1]), ("b", &[2])]);
    if let Some(b) = changed.services.get_mut("b") {
        Arc::make_mut(b).limits.max_connections = 65;
    }
    h.publish(changed).await;
    let sent = h.sent();
    let cds = sent.iter().find(|r| of(CDS, r)).expect("a CDS response");
    // Envoy rejects it alone; the assignment that followed was accepted.
    h.request(nack(cds)).await;
    for r in sent.iter().filter(|r| of(EDS, r)) {
        h.request(ack(r)).await;
    }
    assert!(h.sent().is_empty());
    // The same cluster, accepted this time (another change), answering a CDS request:
    // its assignment follows in the same turn.
    let mut again = routing(3, &[("a", &[1]), ("b", &[2])]);
    if let Some(b) = again.services.get_mut("b") {
        Arc::make_mut(b).limits.max_connections = 66;
    }
    h.cache.update(&again);
    h.request(DeltaDiscoveryRequest {
        type_url: CDS.type_url().into(),
        ..Default::default()
    })
    .await;
    let sent = h.sent();
    let kinds: Vec<(bool, Vec<&str>)> = sent.iter().map(|r| (of(CDS, r), names(r))).collect();
    assert_eq!(
        kinds,
        [(true, vec!["mcp.b"]), (false, vec!["mcp.b"])],
        "{sent:?}"
    );
}

#[tokio::test]
async fn removals_go_after_every_update_of_the_push() {
    let mut h = subscribed(&[("a", &[1]), ("b", &[2])]).await;
    // b with routes of its own, which its removal changes.
    h.publish(own_path(routing(2, &[("a", &[1]), ("b", &[2])]), "b"))
        .await;
    for r in h.sent() {
        h.request(ack(&r)).await;
    }
    h.publish(routing(3, &[("a", &[1])])).await;
    let sent = h.sent();
    let kinds: Vec<(&str, bool)> = sent
        .iter()
        .map(|r| {
            (
                ResourceType::from_type_url(&r.type_url)
                    .expect("known")
                    .short_name(),
                r.removed_resources.is_empty(),
            )
        })
        .collect();
    // The routes stop pointing at b first; then b's cluster and assignment go.
    assert_eq!(
        kinds,
        [("rds", true), ("cds", false), ("eds", false)],
        "{sent:?}"
    );
    assert_eq!(sent[1].removed_resources, ["mcp.b"]);
    assert_eq!(sent[2].removed_resources, ["mcp.b"]);
}

#[tokio::test]
async fn a_reconnecting_envoy_gets_only_what_differs_from_what_it_holds() {
    let mut old = Harness::new();
    old.publish(routing(1, &[("a", &[1]), ("b", &[2])])).await;
    let held = old.request_and_ack(subscribe(CDS, &[])).await;
    let initial: HashMap<String, String> = held[0]
        .resources
        .iter()
        .map(|r| (r.name.clone(), r.version.clone()))
        .collect();

    // toolgate-xds restarts; meanwhile a was changed and b removed.
    let mut h = Harness::new();
    let mut now = routing(1, &[("a", &[1])]);
    if let Some(a) = now.services.get_mut("a") {
        Arc::make_mut(a).limits.max_connections = 65;
    }
    h.publish(now).await;
    h.request(DeltaDiscoveryRequest {
        initial_resource_versions: initial.clone(),
        ..subscribe(CDS, &[])
    })
    .await;
    let sent = h.sent();
    assert_eq!(sent.len(), 1);
    assert_eq!(names(&sent[0]), ["mcp.a"]);
    assert_eq!(sent[0].removed_resources, ["mcp.b"]);

    // Nothing changed: an empty first response, which Envoy needs to finish starting.
    let mut same = Harness::new();
    same.publish(routing(1, &[("a", &[1]), ("b", &[2])])).await;
    same.request(DeltaDiscoveryRequest {
        initial_resource_versions: initial,
        ..subscribe(CDS, &[])
    })
    .await;
    let sent = same.sent();
    assert_eq!(sent.len(), 1);
    assert!(sent[0].resources.is_empty() && sent[0].removed_resources.is_empty());
}

#[tokio::test]
async fn a_rejected_resource_is_not_resent_until_it_changes_and_its_companions_go_alone() {
    let mut h = subscribed(&[("a", &[1]), ("b", &[2]), ("c", &[3])]).await;
    h.publish(routing(2, &[("a", &[1, 7]), ("b", &[2, 8]), ("c", &[3])]))
        .await;
    let sent = h.sent();
    assert_eq!(sent.len(), 1);
    assert_eq!(names(&sent[0]), ["mcp.a", "mcp.b"]);
    // Envoy rejects the response: each assignment goes again alone.
    h.request(nack(&sent[0])).await;
    assert_eq!(h.nacks(EDS), 1);
    let alone = h.sent();
    let alone_names: Vec<Vec<&str>> = alone.iter().map(names).collect();
    assert_eq!(alone_names, [vec!["mcp.a"], vec!["mcp.b"]]);
    // a is accepted, b rejected alone: b is not sent again in that form.
    h.request(ack(&alone[0])).await;
    h.request(nack(&alone[1])).await;
    assert!(
        h.sent().is_empty(),
        "nothing resent after the lone rejection"
    );
    h.publish(routing(
        3,
        &[("a", &[1, 7]), ("b", &[2, 8]), ("c", &[3, 4])],
    ))
    .await;
    let sent = h.sent();
    assert_eq!(sent.len(), 1);
    assert_eq!(names(&sent[0]), ["mcp.c"], "b stays out");
    h.request(ack(&sent[0])).await;
    // b goes back to what Envoy kept: nothing to send.
    h.publish(routing(4, &[("a", &[1, 7]), ("b", &[2]), ("c", &[3, 4])]))
        .await;
    assert!(h.sent().is_empty(), "Envoy holds b in this form");
    // b changes again: it goes out.
    h.publish(routing(
        5,
        &[("a", &[1, 7]), ("b", &[2, 5]), ("c", &[3, 4])],
    ))
    .await;
    let sent = h.sent();
    assert_eq!(sent.len(), 1);
    assert_eq!(names(&sent[0]), ["mcp.b"]);
}

#[tokio::test]
async fn an_unsubscribed_name_is_neither_updated_nor_removed() {
    let mut h = subscribed(&[("a", &[1]), ("b", &[2])]).await;
    h.request(DeltaDiscoveryRequest {
        resource_names_unsubscribe: vec!["mcp.b".into()],
        ..subscribe(EDS, &[])
    })
    .await;
    assert!(h.sent().is_empty());
    h.publish(routing(2, &[("a", &[1])])).await;
    let eds: Vec<_> = h.sent().into_iter().filter(|r| of(EDS, r)).collect();
    assert!(eds.is_empty(), "{eds:?}");
}

/// What `ty` owes, as (name, version) updates and removals.
type Owed = (Vec<(String, String)>, Vec<String>);

/// What the stream owes against the cache's current view, worked out from the names that
/// changed (as a push does) and by walking every name; the stream is left as it was.
/// Also says whether the first was really the shortcut.
fn owed_both_ways(h: &mut Harness, ty: ResourceType) -> (Owed, Owed, bool) {
    let current = h
        .cache
        .current()
        .and_then(|v| v.get(ty).cloned())
        .expect("type served");
    let saved = h
        .stream
        .protocol
        .types
        .get(&ty)
        .and_then(|s| s.reckoned.clone());
    let owed = |p: Pending| -> Owed {
        (
            p.updates.into_iter().map(|u| (u.name, u.version)).collect(),
            p.removals,
        )
    };
    let quick = owed(h.stream.protocol.pending(&mut h.stream.envoy, ty, &current));
    if let Some(state) = h.stream.protocol.types.get_mut(&ty) {
        state.reckoned = None;
    }
    let full = owed(h.stream.protocol.pending(&mut h.stream.envoy, ty, &current));
    if let Some(state) = h.stream.protocol.types.get_mut(&ty) {
        state.reckoned = saved.clone();
    }
    (quick, full, saved.is_some())
}

#[tokio::test]
async fn what_a_push_owes_from_the_changed_names_is_what_a_full_walk_finds() {
    let mut h = subscribed(&[("a", &[1]), ("b", &[2]), ("c", &[3])]).await;
    let steps: [&[(&str, &[u8])]; 5] = [
        // An endpoint change; a new service (its assignment not subscribed); a service gone;
        // endpoints back to an earlier form; everything at once.
        &[("a", &[1]), ("b", &[2, 4]), ("c", &[3])],
        &[("a", &[1]), ("b", &[2, 4]), ("c", &[3]), ("d", &[5])],
        &[("a", &[1]), ("b", &[2, 4]), ("d", &[5])],
        &[("a", &[1]), ("b", &[2]), ("d", &[5])],
        &[("b", &[6]), ("d", &[]), ("e", &[7])],
    ];
    for (i, step) in steps.iter().enumerate() {
        let rejecting = i == 2;
        h.cache.update(&routing(i as u64 + 2, step));
        for ty in [CDS, EDS] {
            let (quick, full, shortcut) = owed_both_ways(&mut h, ty);
            assert!(shortcut, "step {i}: {ty:?} walked in full after plain ACKs");
            assert_eq!(quick, full, "step {i}: {ty:?}");
        }
        let view = h.cache.current().expect("a view");
        assert!(h.stream.push(&view).await.is_ok());
        for r in h.sent() {
            // One rejection along the way: the state it leaves is walked in full once.
            let answer = if rejecting && of(EDS, &r) {
                nack(&r)
            } else {
                ack(&r)
            };
            h.request(answer).await;
        }
        for r in h.sent() {
            h.request(ack(&r)).await;
        }
    }
    assert_eq!(h.nacks(EDS), 1);
}
