use super::*;
use serde_json::Value;

pub(super) fn reg() -> Registry {
    Registry::new(KeyLayout::default())
}

const V1: &[u8] = br#"{"instance_id":"i-1","endpoint":"127.0.0.1:9001","tools":["a"]}"#;

#[test]
fn the_fleets_toolgate_xds_follow_etcd_and_a_full_read_keeps_a_last_good_one() {
    let mut r = reg();
    let me: SocketAddr = "127.0.0.1:19000".parse().expect("addr");
    r.set_control_local(Some("127.0.0.1_19000".into()), me);
    let own = br#"{"admin":"127.0.0.1:19000"}"#;
    let other = br#"{"admin":"127.0.0.2:19000"}"#;
    assert_eq!(r.put("/mcp/xds/127.0.0.1_19000", own, 5, 2, 2), Ok(true));
    assert_eq!(r.put("/mcp/xds/127.0.0.2_19000", other, 6, 3, 3), Ok(true));
    let control = r.routing(1, Instant::now()).control;
    assert_eq!(control.local, Some(me));
    assert_eq!(control.peers, ["127.0.0.2:19000".parse().expect("addr")]);
    let rejected = r
        .put("/mcp/xds/127.0.0.2_19000", b"{}", 6, 3, 4)
        .expect_err("invalid");
    assert_eq!(rejected.reason, "bad_xds_member");
    // A full read where the other's value is invalid and a third is new: the other keeps
    // its last good value; our own key is never one of the others.
    let read = r.reset(
        [
            ("/mcp/xds/127.0.0.1_19000", &own[..], 5, 2, 2),
            ("/mcp/xds/127.0.0.2_19000", &b"{}"[..], 6, 3, 4),
            (
                "/mcp/xds/127.0.0.3_19000",
                &br#"{"admin":"127.0.0.3:19000"}"#[..],
                7,
                5,
                5,
            ),
        ],
        5,
    );
    assert_eq!(read.kept, ["/mcp/xds/127.0.0.2_19000"]);
    let control = r.routing(2, Instant::now()).control;
    assert_eq!(
        control.peers,
        [
            "127.0.0.2:19000".parse().expect("addr"),
            "127.0.0.3:19000".parse().expect("addr")
        ]
    );
    assert_eq!(r.delete("/mcp/xds/127.0.0.3_19000"), Ok(true));
    assert_eq!(
        r.routing(3, Instant::now()).control.peers,
        ["127.0.0.2:19000".parse().expect("addr")]
    );
    // Members are in the state-dir snapshot like any other key.
    assert!(r
        .raw_values()
        .iter()
        .any(|(k, _)| k == "/mcp/xds/127.0.0.2_19000"));
}

#[test]
fn put_and_delete_drive_the_routing() {
    let mut r = reg();
    assert_eq!(r.put("/mcp/services/inv/i-1", V1, 7, 2, 2), Ok(true));
    assert_eq!(
        r.put("/mcp/services/inv/i-1", V1, 8, 2, 3),
        Ok(false),
        "same routing"
    );
    let snap = r.routing(1, Instant::now());
    assert_eq!(snap.services["inv"].endpoints.len(), 1);
    assert_eq!(snap.services["inv"].mcp_path, "/mcp");
    assert_eq!(r.delete("/mcp/services/inv/i-1"), Ok(true));
    let snap = r.routing(2, Instant::now());
    assert!(
        snap.services["inv"].endpoints.is_empty(),
        "a known service keeps an empty assignment"
    );
    assert_eq!(
        snap.services["inv"].mcp_path, "/mcp",
        "and its last MCP path"
    );
}

#[test]
fn garbage_is_rejected_with_its_key_and_keeps_the_last_good_value() {
    let mut r = reg();
    r.put("/mcp/services/inv/i-1", V1, 7, 2, 2).unwrap();
    for (key, value, reason) in [
        ("/mcp/services/inv/i-1", &b"{not json"[..], "bad_value"),
        ("/mcp/services/in v/i-1", V1, "bad_key"),
        ("/mcp/services/inv", V1, "bad_key"),
        ("/mcp/services/inv/i-2", V1, "id_mismatch"),
        (
            "/mcp/services/inv/i-3",
            br#"{"instance_id":"i-3","endpoint":"example.com:80"}"#,
            "bad_endpoint",
        ),
        (
            "/mcp/services/inv/i-4",
            br#"{"instance_id":"i-4","endpoint":"0.0.0.0:80"}"#,
            "refused_endpoint",
        ),
        (
            "/mcp/services/inv/i-1",
            br#"{"instance_id":"i-1","endpoint":"169.254.169.254:80"}"#,
            "refused_endpoint",
        ),
    ] {
        let err = r.put(key, value, 1, 3, 3).unwrap_err();
        assert_eq!(err.reason, reason, "{key}");
        assert_eq!(err.key, key);
    }
    let snap = r.routing(1, Instant::now());
    assert_eq!(snap.services.len(), 1);
    assert_eq!(
        snap.services["inv"].endpoints.len(),
        1,
        "the valid instance keeps serving"
    );
}

#[test]
fn policies_shape_the_filter_config_and_the_bulkhead() {
    let mut r = reg();
    r.put("/mcp/services/inv/i-1", V1, 7, 2, 2).unwrap();
    assert_eq!(
        r.put("/mcp/policies/inv", br#"{"max_requests":7}"#, 0, 3, 3),
        Ok(true)
    );
    assert_eq!(
        r.put(
            "/mcp/policies/inv/a",
            br#"{"failure_rate_percent":20}"#,
            0,
            4,
            4
        ),
        Ok(true)
    );
    let snap = r.routing(1, Instant::now());
    assert_eq!(snap.services["inv"].limits.max_requests, 7);
    let config: FilterConfig = serde_json::from_str(&snap.filter_config).unwrap();
    assert_eq!(config.policy_for("inv", "a").failure_rate_percent, 20);
    assert_eq!(config.policy_for("inv", "b").failure_rate_percent, 50);
    for (key, value) in [
        ("/mcp/policies/inv/a", &br#"{"failure_rate_percent":0}"#[..]),
        ("/mcp/policies/inv/a", b"nope"),
        ("/mcp/policies/in v", b"{}"),
    ] {
        let err = r.put(key, value, 0, 5, 5).unwrap_err();
        assert_eq!(err.key, key);
    }
    let config: FilterConfig =
        serde_json::from_str(&r.routing(2, Instant::now()).filter_config).unwrap();
    assert_eq!(
        config.policy_for("inv", "a").failure_rate_percent,
        20,
        "a bad value keeps the last good one"
    );
    assert_eq!(r.delete("/mcp/policies/inv/a"), Ok(true));
    let config: FilterConfig =
        serde_json::from_str(&r.routing(3, Instant::now()).filter_config).unwrap();
    assert_eq!(config.policy_for("inv", "a").failure_rate_percent, 50);
    assert_eq!(r.put("/mcp/elsewhere/x", b"whatever", 0, 6, 6), Ok(false));
}

#[test]
fn a_policy_another_depends_on_outlives_its_delete_until_the_dependent_goes() {
    let mut r = reg();
    r.put("/mcp/services/orders/i-1", V1, 7, 2, 2).unwrap();
    r.put(
        "/mcp/policies/orders",
        br#"{"max_open_ms":600000}"#,
        0,
        3,
        3,
    )
    .unwrap();
    r.put(
        "/mcp/policies/orders/pay",
        br#"{"open_ms":400000}"#,
        0,
        4,
        4,
    )
    .unwrap();
    // The admin API's check names the dependent and the validation error.
    let refused = r.check_policy_delete("/mcp/policies/orders").unwrap_err();
    assert_eq!(refused.reason, DELETE_BREAKS_DEPENDENT);
    assert!(
        refused.detail.contains("/mcp/policies/orders/pay")
            && refused.detail.contains("max_open_ms"),
        "{}",
        refused.detail
    );
    assert_eq!(r.check_policy_delete("/mcp/policies/orders/pay"), Ok(()));

    // The same delete from the watch: refused, the value stays in effect.
    let err = r.delete("/mcp/policies/orders").unwrap_err();
    assert_eq!(
        (err.key.as_str(), err.reason),
        ("/mcp/policies/orders", DELETE_BREAKS_DEPENDENT)
    );
    let config = published(&mut r);
    config.validate().expect("what the filters get is valid");
    assert_eq!(config.policy_for("orders", "pay").max_open_ms, 600000);

    // The inspection's read of etcd (the service's policy gone) settles like the watch did:
    // no difference, and a resync keeps the value too.
    let read: Vec<(&str, &[u8], i64, i64, i64)> = vec![
        (
            "/mcp/policies/orders/pay",
            br#"{"open_ms":400000}"#,
            0,
            4,
            4,
        ),
        ("/mcp/services/orders/i-1", V1, 7, 2, 2),
    ];
    let mut fresh = r.empty_like();
    let reset = fresh.reset(read.clone(), 5);
    assert_eq!(fresh.fingerprint(), r.fingerprint(), "like with like");
    assert_eq!(reset.kept, ["/mcp/policies/orders".to_string()]);
    assert_eq!(reset.rejected[0].reason, DELETE_BREAKS_DEPENDENT);
    // A missed delete is a difference: the registry did not know etcd lost the key.
    let mut unaware = reg();
    unaware
        .put("/mcp/services/orders/i-1", V1, 7, 2, 2)
        .unwrap();
    unaware
        .put(
            "/mcp/policies/orders",
            br#"{"max_open_ms":600000}"#,
            0,
            3,
            3,
        )
        .unwrap();
    unaware
        .put(
            "/mcp/policies/orders/pay",
            br#"{"open_ms":400000}"#,
            0,
            4,
            4,
        )
        .unwrap();
    let mut fresh = unaware.empty_like();
    fresh.reset(read.clone(), 5);
    assert_ne!(fresh.fingerprint(), unaware.fingerprint());
    unaware.reset(read, 5);
    assert_eq!(unaware.fingerprint(), r.fingerprint(), "a resync learns it");

    // The dependent leaves: the held delete takes effect with it.
    assert_eq!(r.delete("/mcp/policies/orders/pay"), Ok(true));
    let config = published(&mut r);
    assert!(!config.services.contains_key("orders"), "{config:?}");
    // A cold start reading only the dependent refuses it: the configuration stays valid.
    let mut cold = reg();
    let reset = cold.reset(
        [(
            "/mcp/policies/orders/pay",
            &br#"{"open_ms":400000}"#[..],
            0,
            4,
            4,
        )],
        5,
    );
    assert_eq!(reset.rejected[0].reason, "bad_policy");
    published(&mut cold).validate().expect("valid");
}

#[test]
fn the_filter_learns_every_services_tools_and_keeps_them_when_it_empties() {
    let mut r = reg();
    let catalog = |r: &mut Registry, generation| {
        let config: FilterConfig =
            serde_json::from_str(&r.routing(generation, Instant::now()).filter_config).unwrap();
        config.catalog
    };
    r.put("/mcp/services/inv/i-1", V1, 7, 2, 2).unwrap();
    r.put(
        "/mcp/services/inv/i-2",
        br#"{"instance_id":"i-2","endpoint":"127.0.0.1:9002","tools":["a","b"]}"#,
        8,
        3,
        3,
    )
    .unwrap();
    r.put(
        "/mcp/services/bare/i-1",
        br#"{"instance_id":"i-1","endpoint":"127.0.0.1:9003"}"#,
        9,
        4,
        4,
    )
    .unwrap();
    let c = catalog(&mut r, 1);
    assert_eq!(c["inv"], BTreeSet::from(["a".to_string(), "b".to_string()]));
    assert!(c["bare"].is_empty(), "registrations that list no tools");
    assert_eq!(r.delete("/mcp/services/inv/i-2"), Ok(true));
    let c = catalog(&mut r, 2);
    assert_eq!(c["inv"], BTreeSet::from(["a".to_string()]));
    assert_eq!(r.delete("/mcp/services/inv/i-1"), Ok(true));
    let c = catalog(&mut r, 3);
    assert_eq!(
        c["inv"],
        BTreeSet::from(["a".to_string()]),
        "an emptied service keeps its last list, as it keeps its route"
    );
}

#[test]
fn a_reset_admits_again_only_the_instances_that_changed() {
    let mut r = reg();
    let key = "/mcp/services/inv/i-1";
    let sk = ServiceKey {
        service: "inv".into(),
        instance: "i-1".into(),
    };
    r.put(key, V1, 7, 2, 2).unwrap();
    let admitted = |r: &Registry| Arc::clone(&r.instance(&sk).unwrap().json);
    let first = admitted(&r);

    let read = r.reset([(key, V1, 7, 2, 2)], 9);
    assert!(read.rejected.is_empty() && read.kept.is_empty());
    assert!(
        Arc::ptr_eq(&first, &admitted(&r)),
        "unchanged: left as it was"
    );

    // Other bytes at the same revisions (an etcd restored from a snapshot can reuse them):
    // the value decides, and the new one is admitted.
    let moved: &[u8] = br#"{"instance_id":"i-1","endpoint":"127.0.0.1:9002","tools":["a"]}"#;
    r.reset([(key, moved, 7, 2, 2)], 10);
    assert_eq!(r.instance(&sk).unwrap().addr().port(), 9002);
    // A new lease alone is a change too: the lease is what the instance lives by.
    r.reset([(key, moved, 8, 2, 2)], 11);
    assert_eq!(r.instance(&sk).unwrap().lease, 8);
    // And what a read no longer has is gone, its probe stopped.
    r.take_dirty();
    r.reset(std::iter::empty(), 12);
    assert_eq!(r.instance_count(), 0);
    assert!(r.take_dirty().contains(&sk));
}

#[test]
fn reset_replaces_everything() {
    let mut r = reg();
    r.put("/mcp/services/inv/i-1", V1, 7, 2, 2).unwrap();
    let v2: &[u8] = br#"{"instance_id":"i-2","endpoint":"127.0.0.1:9002"}"#;
    let read = r.reset(
        [
            ("/mcp/services/fin/i-2", v2, 1, 5, 5),
            ("/mcp/services/fin/bad", &b"x"[..], 1, 5, 5),
        ],
        9,
    );
    assert_eq!(read.rejected.len(), 1);
    assert!(read.kept.is_empty(), "fin/bad never had a good value");
    assert_eq!(r.revision(), 9);
    assert_eq!(r.instance_count(), 1);
    let snap = r.routing(1, Instant::now());
    assert_eq!(snap.services["fin"].endpoints[0].instance_id, "i-2");
}

#[test]
fn a_reset_keeps_the_last_good_value_of_every_key_invalid_in_the_read() {
    let mut r = reg();
    let v2: &[u8] = br#"{"instance_id":"i-2","endpoint":"127.0.0.1:9002"}"#;
    r.put("/mcp/services/inv/i-1", V1, 7, 2, 2).unwrap();
    r.put("/mcp/services/inv/i-2", v2, 7, 3, 3).unwrap();
    r.put("/mcp/policies/inv", br#"{"max_requests":7}"#, 0, 4, 4)
        .unwrap();
    r.put(
        "/mcp/overrides/inv/a",
        br#"{"mode":"force_open","reason":"maintenance"}"#,
        0,
        5,
        5,
    )
    .unwrap();
    let read = r.reset(
        [
            ("/mcp/overrides/inv/a", &b"{"[..], 0, 9, 9),
            ("/mcp/policies/inv", br#"{"max_requests":0}"#, 0, 9, 9),
            ("/mcp/services/inv/i-1", b"garbage", 7, 9, 9),
            // i-2 is gone from etcd: deleted, not invalid.
            ("/mcp/services/inv/i-3", b"garbage", 7, 9, 9),
        ],
        9,
    );
    assert_eq!(read.rejected.len(), 4);
    assert_eq!(
        read.kept,
        vec![
            "/mcp/overrides/inv/a".to_string(),
            "/mcp/policies/inv".to_string(),
            "/mcp/services/inv/i-1".to_string(),
        ],
        "i-3 never had a good value"
    );
    let snap = r.routing(1, Instant::now());
    let ids: Vec<&str> = snap.services["inv"]
        .endpoints
        .iter()
        .map(|e| e.instance_id.as_str())
        .collect();
    assert_eq!(ids, ["i-1"], "i-1 keeps its last good value; i-2 left");
    assert_eq!(snap.services["inv"].limits.max_requests, 7);
    assert_eq!(r.overrides().len(), 1);
    assert_eq!(
        r.find_by_addr("inv", "127.0.0.1:9001".parse().unwrap())
            .map(|k| k.instance.as_str()),
        Some("i-1")
    );
}

#[test]
fn health_decides_what_envoy_gets_and_survives_a_resync() {
    use crate::health::machine::ProbeResult;
    let probed = Arc::new(HealthConfig::default());
    let mut r = Registry::with_health(KeyLayout::default(), probed.clone());
    let v2: &[u8] = br#"{"instance_id":"i-2","endpoint":"127.0.0.1:9002","weight":3}"#;
    r.put("/mcp/services/inv/i-1", V1, 7, 2, 2).unwrap();
    r.put("/mcp/services/inv/i-2", v2, 7, 3, 3).unwrap();
    let dirty = r.take_dirty();
    assert_eq!(dirty.len(), 2, "both need a probe task");
    let routed = |r: &mut Registry| {
        r.routing(1, Instant::now()).services["inv"]
            .endpoints
            .clone()
    };
    assert!(routed(&mut r).is_empty(), "UNKNOWN is not routed");

    let pass = || ProbeResult {
        at: SystemTime::now(),
        ok: true,
        latency_ms: 1.0,
        detail: "HTTP 200".into(),
        refused: false,
        restarted: false,
    };
    let now = Instant::now();
    let k1 = ServiceKey {
        service: "inv".into(),
        instance: "i-1".into(),
    };
    let k2 = ServiceKey {
        service: "inv".into(),
        instance: "i-2".into(),
    };
    r.health_mut(&k1).unwrap().on_probe(pass(), now, &probed);
    r.health_mut(&k2).unwrap().on_probe(pass(), now, &probed);
    let bad = crate::health::machine::CallCounts {
        http_5xx: 20,
        ..Default::default()
    };
    r.health_mut(&k2).unwrap().on_calls(&bad, now, &probed);
    let eps = routed(&mut r);
    assert_eq!(eps[0].weight, WEIGHT_SCALE, "UP: the registered weight");
    assert_eq!(eps[1].health, EndpointHealth::Healthy);
    assert_eq!(eps[1].weight, 3 * WEIGHT_SCALE / 10, "UNHEALTHY: a tenth");

    // A resync with the same registrations keeps their states and asks for no new task.
    r.reset(
        [
            ("/mcp/services/inv/i-1", V1, 8, 4, 4),
            ("/mcp/services/inv/i-2", v2, 8, 4, 4),
        ],
        4,
    );
    assert!(r.take_dirty().is_empty());
    assert_eq!(routed(&mut r).len(), 2);
    // The same key at a new address is a new server: UNKNOWN again.
    r.put(
        "/mcp/services/inv/i-1",
        br#"{"instance_id":"i-1","endpoint":"127.0.0.1:9009"}"#,
        8,
        5,
        5,
    )
    .unwrap();
    assert_eq!(
        r.take_dirty().into_iter().collect::<Vec<_>>(),
        vec![k1.clone()]
    );
    assert_eq!(routed(&mut r).len(), 1);
    assert_eq!(
        r.find_by_addr("inv", "127.0.0.1:9009".parse().unwrap()),
        Some(&k1)
    );
    assert_eq!(
        r.find_by_addr("inv", "127.0.0.1:9001".parse().unwrap()),
        None
    );
}

#[test]
fn the_offline_listings_follow_names_and_definitions_and_nothing_else() {
    let mut r = reg();
    r.put("/mcp/services/inv/i-1", V1, 7, 2, 2).unwrap();
    let listings = |r: &mut Registry| -> (Value, Arc<str>) {
        let sent = r.routing(1, Instant::now()).filter_config;
        let v: Value = serde_json::from_str(&sent).unwrap();
        (v["offline_listings"].clone(), sent)
    };
    let (first, _) = listings(&mut r);
    assert_eq!(first["default"][0]["name"], "inv__a");
    assert_eq!(first["default"][0]["description"], offline::NOT_READ);
    // The catalog read the definition: listed as read.
    let def = serde_json::json!({"name": "a", "description": "Does a.",
        "inputSchema": {"type": "object", "properties": {"x": {"type": "number"}}}});
    assert!(r.set_definitions("inv", Some(vec![def.clone()])));
    assert!(
        !r.set_definitions("inv", Some(vec![def])),
        "the same read again"
    );
    let (read, sent) = listings(&mut r);
    assert_eq!(read["default"][0]["description"], "Does a.");
    assert_eq!(
        read["default"][0]["inputSchema"]["properties"]["x"]["type"],
        "number"
    );
    // A fleet opening changes the configuration but not the listings (not made again).
    let made = r.filter_made().config;
    let before = r.offline_listings(&r.virtual_routes());
    r.put(
        "/mcp/breakers/inv/a",
        br#"{"until_ms":99999999999999,"opened_by":"gw","opened_at_ms":1}"#,
        0,
        9,
        9,
    )
    .unwrap();
    let (after, sent_after) = listings(&mut r);
    assert_ne!(sent, sent_after);
    assert!(!Arc::ptr_eq(&made, &r.filter_made().config));
    assert!(Arc::ptr_eq(
        &before,
        &r.offline_listings(&r.virtual_routes())
    ));
    assert_eq!(read, after);
    assert!(
        after["default"][0].get("_meta").is_none(),
        "no availability"
    );
    // Nothing read and no names: no field at all.
    let empty = reg();
    assert!(!empty.filter_made().json.contains("offline_listings"));
}

pub(super) fn instance(id: &str, port: u16, tools: &[&str]) -> Vec<u8> {
    serde_json::json!({"instance_id": id, "endpoint": format!("127.0.0.1:{port}"), "tools": tools})
        .to_string()
        .into_bytes()
}

fn published(r: &mut Registry) -> FilterConfig {
    serde_json::from_str(&r.routing(1, Instant::now()).filter_config).unwrap()
}

const BARE: &[u8] = br#"{"naming":"bare"}"#;

#[test]
fn the_kept_filter_configuration_follows_every_input() {
    let mut r = reg();
    let mut generation = 0;
    // After each change: what the publish sends is what a registry without a memo makes.
    let mut check = |r: &mut Registry, what: &str| -> Arc<str> {
        generation += 1;
        let sent = r.routing(generation, Instant::now()).filter_config;
        let fresh = r.clone().filter_made().json;
        assert_eq!(&*sent, &*fresh, "after {what}");
        sent
    };
    r.put(
        "/mcp/services/inv/i-1",
        &instance("i-1", 9001, &["a"]),
        7,
        2,
        2,
    )
    .unwrap();
    check(&mut r, "a first service");
    r.put(
        "/mcp/services/pay/i-1",
        &instance("i-1", 9101, &["a"]),
        7,
        3,
        3,
    )
    .unwrap();
    let before = check(&mut r, "a second service with a contested name");
    r.put(
        "/mcp/services/inv/i-2",
        &instance("i-2", 9002, &["a"]),
        7,
        4,
        4,
    )
    .unwrap();
    let same = check(&mut r, "an instance that changes no input");
    assert!(Arc::ptr_eq(&before, &same), "kept, not made again");
    r.put(
        "/mcp/services/inv/i-3",
        &instance("i-3", 9003, &["a", "b"]),
        7,
        5,
        5,
    )
    .unwrap();
    check(&mut r, "a new tool");
    r.put("/mcp/policies/inv", br#"{"max_requests":7}"#, 0, 6, 6)
        .unwrap();
    check(&mut r, "a policy");
    r.put(
        "/mcp/overrides/inv/a",
        br#"{"mode":"force_open","reason":"maintenance"}"#,
        0,
        7,
        7,
    )
    .unwrap();
    check(&mut r, "an override");
    r.put("/mcp/virtual/ops", BARE, 0, 8, 8).unwrap();
    check(&mut r, "a virtual server");
    // inv's oldest instance leaves: pay becomes the older service and keeps the bare name.
    assert_eq!(r.delete("/mcp/services/inv/i-1"), Ok(true));
    assert_eq!(r.delete("/mcp/services/inv/i-2"), Ok(true));
    check(&mut r, "a service growing younger");
    assert!(r.set_legacy_revision("pay", Some("2025-06-18".into())));
    check(&mut r, "a legacy revision");
    assert_eq!(r.delete("/mcp/overrides/inv/a"), Ok(true));
    check(&mut r, "an override lifted");
    assert_eq!(r.delete("/mcp/policies/inv"), Ok(true));
    check(&mut r, "a policy removed");
    r.put(
        "/mcp/services/solo/i-1",
        &instance("i-1", 9201, &["z"]),
        7,
        10,
        10,
    )
    .unwrap();
    let before = check(&mut r, "a service with a tool nobody else has");
    r.put(
        "/mcp/services/solo/i-2",
        &instance("i-2", 9202, &["z"]),
        7,
        11,
        11,
    )
    .unwrap();
    assert_eq!(r.delete("/mcp/services/solo/i-1"), Ok(true));
    let same = check(&mut r, "an age that decides no name");
    assert!(Arc::ptr_eq(&before, &same), "kept, not made again");
    let kvs = [(
        "/mcp/services/pay/i-1",
        &instance("i-1", 9101, &["c"])[..],
        7,
        3,
        9,
    )];
    r.reset(kvs.iter().map(|(k, v, l, c, m)| (*k, *v, *l, *c, *m)), 9);
    check(&mut r, "a full resync");
}

#[test]
fn the_filters_learn_the_legacy_services_while_they_exist() {
    let mut r = reg();
    r.put("/mcp/services/inv/i-1", V1, 7, 2, 2).unwrap();
    assert!(published(&mut r).legacy_revisions.is_empty());
    assert!(r.set_legacy_revision("inv", Some("2025-06-18".into())));
    assert!(!r.set_legacy_revision("inv", Some("2025-06-18".into())));
    assert_eq!(
        published(&mut r)
            .legacy_revisions
            .get("inv")
            .map(String::as_str),
        Some("2025-06-18")
    );
    // Not for a service the registry does not have.
    assert!(r.set_legacy_revision("gone", Some("2025-06-18".into())));
    assert!(!published(&mut r).legacy_revisions.contains_key("gone"));
    assert!(r.set_legacy_revision("inv", None));
    assert!(published(&mut r).legacy_revisions.is_empty());
}

#[test]
fn a_service_registered_without_tools_gets_the_names_its_server_listed() {
    let mut r = reg();
    r.put(
        "/mcp/services/bare/i-1",
        &instance("i-1", 9001, &[]),
        7,
        2,
        2,
    )
    .unwrap();
    r.put(
        "/mcp/services/inv/i-1",
        &instance("i-1", 9002, &["a"]),
        7,
        3,
        3,
    )
    .unwrap();
    assert_eq!(published(&mut r).catalog["bare"], BTreeSet::new());
    let listed = BTreeSet::from(["fail_order".to_string(), "read_order".to_string()]);
    assert!(r.set_discovered_tools("bare", Some(listed.clone())));
    assert!(!r.set_discovered_tools("bare", Some(listed.clone())));
    assert_eq!(published(&mut r).catalog["bare"], listed);
    // A service whose registrations list tools keeps its registered list.
    assert!(r.set_discovered_tools("inv", Some(listed.clone())));
    assert_eq!(
        published(&mut r).catalog["inv"],
        BTreeSet::from(["a".to_string()])
    );
    assert!(r.set_discovered_tools("bare", None));
    assert_eq!(published(&mut r).catalog["bare"], BTreeSet::new());
}

#[test]
fn virtual_servers_are_admitted_whole_or_not_at_all() {
    let mut r = reg();
    r.put("/mcp/services/inv/i-1", V1, 7, 2, 2).unwrap();
    let config = published(&mut r);
    assert_eq!(
        config.virtual_servers["default"].tools["inv__a"].tool, "a",
        "the built-in default: every tool, prefixed"
    );
    assert_eq!(r.put("/mcp/virtual/ops", BARE, 0, 3, 3), Ok(true));
    assert_eq!(
        r.put("/mcp/virtual/ops", BARE, 0, 3, 4),
        Ok(false),
        "same definition"
    );
    // Naming a service that is not registered (yet) is admitted.
    let later = br#"{"services":["inv","billing"]}"#;
    assert_eq!(r.put("/mcp/virtual/later", later, 0, 5, 5), Ok(true));
    for (key, value, reason, field) in [
        (
            "/mcp/virtual/ops",
            &br#"{"include":["a/b/c"]}"#[..],
            "bad_virtual",
            "include[0]",
        ),
        (
            "/mcp/virtual/ops",
            br#"{"exlude":["x"]}"#,
            "bad_virtual",
            "exlude",
        ),
        ("/mcp/virtual/ops", b"{not json", "bad_virtual", "value"),
        (
            "/mcp/virtual/ops",
            br#"{"services":["ok","bad name"]}"#,
            "bad_virtual",
            "services[1]",
        ),
        ("/mcp/virtual/b d", BARE, "bad_key", "b d"),
    ] {
        let err = r.put(key, value, 0, 6, 6).unwrap_err();
        assert_eq!((err.reason, err.key.as_str()), (reason, key));
        assert!(err.detail.contains(field), "{field}: {}", err.detail);
        assert_eq!(
            r.check(key, value),
            Err(err),
            "check refuses what the watch refuses"
        );
    }
    assert_eq!(r.check("/mcp/virtual/ops", BARE), Ok(()));
    let config = published(&mut r);
    assert_eq!(
        config.virtual_servers["ops"].tools["a"].service, "inv",
        "the last good definition stays"
    );
    assert!(config.virtual_servers["later"].tools.contains_key("inv__a"));
    assert_eq!(r.delete("/mcp/virtual/ops"), Ok(true));
    assert_eq!(r.delete("/mcp/virtual/ops"), Ok(false));
    assert!(!published(&mut r).virtual_servers.contains_key("ops"));
}

#[test]
fn the_older_service_keeps_a_contested_bare_name() {
    let mut r = reg();
    r.put("/mcp/virtual/default", BARE, 0, 1, 1).unwrap();
    // zeta registered first although alpha sorts first.
    r.put(
        "/mcp/services/zeta/z-1",
        &instance("z-1", 9001, &["search"]),
        1,
        10,
        10,
    )
    .unwrap();
    r.put(
        "/mcp/services/alpha/a-1",
        &instance("a-1", 9002, &["search"]),
        1,
        20,
        20,
    )
    .unwrap();
    let names = |r: &mut Registry| -> Vec<(String, String)> {
        published(r).virtual_servers["default"]
            .tools
            .iter()
            .map(|(name, t)| (name.clone(), t.service.clone()))
            .collect()
    };
    let before = names(&mut r);
    assert_eq!(
        before,
        [
            ("alpha__search".to_string(), "alpha".to_string()),
            ("search".to_string(), "zeta".to_string())
        ]
    );
    // A third service with the same tool changes nothing of the others' names.
    r.put(
        "/mcp/services/beta/b-1",
        &instance("b-1", 9003, &["search"]),
        1,
        30,
        30,
    )
    .unwrap();
    let after = names(&mut r);
    assert!(before.iter().all(|n| after.contains(n)), "{after:?}");
    assert!(after.contains(&("beta__search".to_string(), "beta".to_string())));

    // An overwrite keeps the key's create revision; a second, younger instance does not
    // make its service younger.
    r.put(
        "/mcp/services/zeta/z-1",
        &instance("z-1", 9001, &["search"]),
        2,
        10,
        40,
    )
    .unwrap();
    r.put(
        "/mcp/services/zeta/z-2",
        &instance("z-2", 9004, &["search"]),
        2,
        41,
        41,
    )
    .unwrap();
    assert_eq!(r.service_ages()["zeta"], 10);
    // The oldest instance leaves: until the fleet recorded its age (see
    // `a_recorded_age_keeps_a_contested_name_across_a_re_registration`), the service is as
    // old as its oldest live key.
    assert_eq!(r.delete("/mcp/services/zeta/z-1"), Ok(true));
    assert_eq!(r.service_ages()["zeta"], 41);
    // zeta is now the younger: alpha takes the bare name.
    let n = names(&mut r);
    assert!(
        n.contains(&("search".to_string(), "alpha".to_string())),
        "{n:?}"
    );
    assert!(
        n.contains(&("zeta__search".to_string(), "zeta".to_string())),
        "{n:?}"
    );
    // An emptied service keeps its last age, and with it its names, while it is known.
    assert_eq!(r.delete("/mcp/services/alpha/a-1"), Ok(true));
    assert_eq!(r.service_ages()["alpha"], 20);
    assert!(names(&mut r).contains(&("search".to_string(), "alpha".to_string())));
}

#[test]
fn a_recorded_age_keeps_a_contested_name_across_a_re_registration() {
    let mut r = reg();
    let wanted = r.ages_wanted();
    r.put("/mcp/virtual/default", BARE, 0, 1, 1).unwrap();
    r.put(
        "/mcp/services/zeta/z-1",
        &instance("z-1", 9001, &["search"]),
        1,
        10,
        10,
    )
    .unwrap();
    r.put(
        "/mcp/services/alpha/a-1",
        &instance("a-1", 9002, &["search"]),
        1,
        20,
        20,
    )
    .unwrap();
    // Both are to be recorded, at the ages their keys give.
    assert_eq!(
        r.unrecorded_ages(),
        [("alpha".to_string(), 20), ("zeta".to_string(), 10)]
    );
    assert!(futures::FutureExt::now_or_never(wanted.notified()).is_some());
    for (service, revision) in [("zeta", 10), ("alpha", 20)] {
        let key = format!("/mcp/service-ages/{service}");
        let value = format!(r#"{{"revision":{revision}}}"#);
        assert_eq!(r.put(&key, value.as_bytes(), 0, 30, 30), Ok(false));
    }
    assert!(r.unrecorded_ages().is_empty());
    let bare = |r: &mut Registry| {
        published(r).virtual_servers["default"].tools["search"]
            .service
            .clone()
    };
    assert_eq!(bare(&mut r), "zeta");
    // zeta's registrar stops and registers again: new keys, younger than alpha's.
    assert_eq!(r.delete("/mcp/services/zeta/z-1"), Ok(true));
    r.put(
        "/mcp/services/zeta/z-2",
        &instance("z-2", 9003, &["search"]),
        2,
        40,
        40,
    )
    .unwrap();
    assert_eq!(r.service_ages()["zeta"], 10, "the recorded age");
    assert_eq!(bare(&mut r), "zeta", "the bare name stays");
    // A resync and a restart from the state snapshot keep it.
    let values = r.raw_values();
    assert!(values
        .iter()
        .any(|(k, v)| k == "/mcp/service-ages/zeta" && v == r#"{"revision":10}"#));
    let mut restarted = reg();
    restarted.reset(
        values
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_bytes(), 0, 0, 0)),
        41,
    );
    assert_eq!(bare(&mut restarted), "zeta");
    // A bad value is refused; the last good age stays.
    let err = r
        .put(
            "/mcp/service-ages/zeta",
            br#"{"revision":"old"}"#,
            0,
            42,
            42,
        )
        .unwrap_err();
    assert_eq!(err.reason, "bad_service_age");
    assert_eq!(r.service_ages()["zeta"], 10);
    // An operator deletes it: it is recorded again from the instance keys.
    assert_eq!(r.delete("/mcp/service-ages/zeta"), Ok(true));
    assert_eq!(r.unrecorded_ages(), [("zeta".to_string(), 40)]);
    assert_eq!(bare(&mut r), "alpha");
}

#[test]
fn the_state_snapshot_keeps_virtual_servers_and_service_ages() {
    let mut r = reg();
    r.put(
        "/mcp/services/zeta/z-1",
        &instance("z-1", 9001, &["search"]),
        1,
        10,
        12,
    )
    .unwrap();
    r.put(
        "/mcp/services/alpha/a-1",
        &instance("a-1", 9002, &["search"]),
        1,
        20,
        20,
    )
    .unwrap();
    r.put("/mcp/virtual/default", BARE, 0, 21, 21).unwrap();
    let values = r.raw_values();
    let created = r.create_revisions();
    assert!(values
        .iter()
        .any(|(k, v)| k == "/mcp/virtual/default" && v.as_bytes() == BARE));
    assert_eq!(created["/mcp/services/zeta/z-1"], 10);

    // A restart serving the snapshot (leases and mod revisions unknown).
    let mut restarted = reg();
    restarted.reset(
        values.iter().map(|(k, v)| {
            (
                k.as_str(),
                v.as_bytes(),
                0,
                created.get(k).copied().unwrap_or(0),
                0,
            )
        }),
        21,
    );
    assert_eq!(
        published(&mut restarted).virtual_servers,
        published(&mut r).virtual_servers
    );
    assert_eq!(
        published(&mut restarted).virtual_servers["default"].tools["search"].service,
        "zeta"
    );
    // A resync whose read holds a bad definition keeps the last good one.
    let read = restarted.reset(
        values.iter().map(|(k, v)| {
            let v = if k.contains("/virtual/") {
                &b"{\"naming\":1}"[..]
            } else {
                v.as_bytes()
            };
            (k.as_str(), v, 0, created.get(k).copied().unwrap_or(0), 0)
        }),
        22,
    );
    assert_eq!(read.kept, ["/mcp/virtual/default".to_string()]);
    assert_eq!(read.rejected[0].reason, "bad_virtual");
    assert_eq!(
        published(&mut restarted).virtual_servers["default"].tools["search"].service,
        "zeta"
    );
}

const AUTH: &[u8] = br#"{"resource": "http://127.0.0.1:10000/",
    "authorization_servers": ["http://127.0.0.1:9000"], "required": ["inv"],
    "issuers": [{"issuer": "http://127.0.0.1:9000",
                 "jwks": {"remote": {"uri": "http://127.0.0.1:9000/jwks.json"}}}]}"#;
const READERS: &[u8] = br#"{"rules": [{"tools": ["read_*"], "roles": ["reader"]}]}"#;

#[test]
fn an_auth_configuration_is_admitted_and_shared_while_unchanged() {
    let mut r = reg();
    r.put("/mcp/services/inv/i-1", V1, 7, 2, 2).unwrap();
    assert!(r.auth_config().is_none());
    assert!(
        published(&mut r).auth.is_none(),
        "no configuration: no auth"
    );
    assert!(r.routing(1, Instant::now()).auth.is_none());
    assert_eq!(r.put("/mcp/auth/config", AUTH, 0, 3, 3), Ok(true));
    assert_eq!(
        r.auth_config().map(|c| c.resource.as_str()),
        Some("http://127.0.0.1:10000")
    );
    let first = r
        .routing(2, Instant::now())
        .auth
        .expect("auth in the snapshot");
    assert!(first.requires("inv"));
    // The same configuration, even written differently, changes nothing.
    let respaced = String::from_utf8_lossy(AUTH).replace("\n", " ");
    assert_eq!(
        r.put("/mcp/auth/config", respaced.as_bytes(), 0, 3, 4),
        Ok(false)
    );
    let second = r.routing(3, Instant::now()).auth.expect("still there");
    assert!(
        Arc::ptr_eq(&first, &second),
        "an unchanged config keeps its Arc"
    );
    let auth = published(&mut r).auth.expect("the filter's share");
    assert_eq!(auth.resource, "http://127.0.0.1:10000");
    assert_eq!(auth.required, ["inv"]);
    assert!(auth.resource_audience.contains("http://127.0.0.1:9000"));
    // A resync reading the same configuration keeps the Arc too.
    let values = r.raw_values();
    r.reset(
        values
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_bytes(), 7, 2, 2)),
        9,
    );
    let third = r.routing(4, Instant::now()).auth.expect("after the reset");
    assert!(Arc::ptr_eq(&first, &third), "a reset that changed nothing");
}

#[test]
fn a_bad_auth_value_is_rejected_and_the_last_good_one_kept() {
    let mut r = reg();
    r.put("/mcp/services/inv/i-1", V1, 7, 2, 2).unwrap();
    r.put("/mcp/auth/config", AUTH, 0, 3, 3).unwrap();
    r.put("/mcp/auth/rules/inv", READERS, 0, 4, 4).unwrap();
    let bad_config = br#"{"resource": "http://gw", "authorization_servers": ["http://idp"],
        "issuers": [{"issuer": "i", "jwks": {"remote": {"uri": "ftp://x"}}}]}"#;
    for (key, value, reason, field) in [
        (
            "/mcp/auth/config",
            &bad_config[..],
            "bad_auth",
            "issuers[0].jwks.remote.uri",
        ),
        ("/mcp/auth/config", b"{not json", "bad_auth", "value"),
        (
            "/mcp/auth/rules/inv",
            br#"{"rules": [{"tools": ["a"]}]}"#,
            "bad_auth",
            "rules[0]",
        ),
        (
            "/mcp/auth/virtual/ops",
            br#"{"rules": [{"tools": ["a"], "role": ["x"]}]}"#,
            "bad_auth",
            "rules[0].role",
        ),
        ("/mcp/auth/rules/in v", READERS, "bad_key", "in v"),
        ("/mcp/auth/other", READERS, "bad_key", "other"),
    ] {
        let err = r.put(key, value, 0, 5, 5).unwrap_err();
        assert_eq!((err.reason, err.key.as_str()), (reason, key));
        assert!(err.detail.contains(field), "{field}: {}", err.detail);
        assert_eq!(
            r.check(key, value),
            Err(err),
            "check refuses what the watch refuses"
        );
    }
    assert_eq!(r.check("/mcp/auth/config", AUTH), Ok(()));
    let auth = published(&mut r).auth.expect("the last good configuration");
    assert_eq!(auth.resource, "http://127.0.0.1:10000");
    assert_eq!(auth.services["inv"].rules[0].roles, ["reader"]);
    assert!(auth.virtual_servers.is_empty());

    // A resync whose read holds bad values keeps the last good ones as well.
    let read = r.reset(
        [
            ("/mcp/auth/config", &bad_config[..], 0, 9, 9),
            ("/mcp/auth/rules/inv", b"[]", 0, 9, 9),
            ("/mcp/auth/virtual/ops", b"{", 0, 9, 9),
            ("/mcp/services/inv/i-1", V1, 7, 2, 2),
        ],
        9,
    );
    let reasons: Vec<&str> = read.rejected.iter().map(|r| r.reason).collect();
    assert_eq!(reasons, ["bad_auth", "bad_auth", "bad_auth"]);
    assert_eq!(
        read.kept,
        [
            "/mcp/auth/config".to_string(),
            "/mcp/auth/rules/inv".to_string()
        ],
        "ops never had a good rule set"
    );
    let auth = published(&mut r).auth.expect("kept across the reset");
    assert_eq!(auth.resource, "http://127.0.0.1:10000");
    assert!(auth.services.contains_key("inv"));
    assert!(r.routing(2, Instant::now()).auth.is_some());
}

#[test]
fn rule_sets_reach_the_filter_with_a_configuration_and_leave_on_delete() {
    let mut r = reg();
    r.put("/mcp/services/inv/i-1", V1, 7, 2, 2).unwrap();
    r.put("/mcp/virtual/ops", BARE, 0, 3, 3).unwrap();
    // A rule set for a service not registered (yet) is admitted, as are rule sets before
    // any configuration: kept, but not sent (nothing would check the callers).
    assert_eq!(r.put("/mcp/auth/rules/billing", READERS, 0, 4, 4), Ok(true));
    assert_eq!(r.put("/mcp/auth/rules/inv", READERS, 0, 5, 5), Ok(true));
    assert_eq!(r.put("/mcp/auth/rules/inv", READERS, 0, 5, 6), Ok(false));
    assert_eq!(r.put("/mcp/auth/virtual/ops", READERS, 0, 6, 6), Ok(true));
    assert!(published(&mut r).auth.is_none());
    assert_eq!(r.auth_service_rules().count(), 2);
    r.put("/mcp/auth/config", AUTH, 0, 7, 7).unwrap();
    let auth = published(&mut r).auth.expect("configured");
    let services: Vec<&String> = auth.services.keys().collect();
    assert_eq!(services, ["billing", "inv"]);
    assert_eq!(
        auth.virtual_servers["ops"],
        ToolRules::parse(READERS).unwrap()
    );
    assert!(auth.requires("inv") && !auth.requires("ops"));

    assert_eq!(r.delete("/mcp/auth/rules/billing"), Ok(true));
    assert_eq!(
        r.delete("/mcp/auth/rules/billing"),
        Ok(false),
        "already gone"
    );
    assert_eq!(r.delete("/mcp/auth/virtual/ops"), Ok(true));
    let auth = published(&mut r).auth.expect("configured");
    assert_eq!(auth.services.keys().collect::<Vec<_>>(), ["inv"]);
    assert!(auth.virtual_servers.is_empty());
    assert_eq!(r.delete("/mcp/auth/config"), Ok(true));
    assert_eq!(r.delete("/mcp/auth/config"), Ok(false));
    assert!(r.auth_config().is_none());
    assert!(published(&mut r).auth.is_none());
    assert!(r.routing(9, Instant::now()).auth.is_none());
    assert_eq!(r.auth_service_rules().count(), 1, "the rules stay, unused");
}

#[test]
fn claim_header_names_reach_the_filter_with_or_without_a_configuration() {
    let mut r = reg();
    let with_claims = |header: &str| {
        format!(
            r#"{{"rules": [{{"tools": ["*"], "subjects": ["*"]}}],
                 "claim_headers": {{"sub": "{header}", "email": "X-Mail"}}}}"#
        )
    };
    r.put(
        "/mcp/auth/rules/inv",
        with_claims("X-Caller").as_bytes(),
        0,
        2,
        2,
    )
    .unwrap();
    r.put(
        "/mcp/auth/virtual/ops",
        with_claims("x_user").as_bytes(),
        0,
        3,
        3,
    )
    .unwrap();
    let config = published(&mut r);
    assert!(config.auth.is_none(), "no configuration");
    let names: Vec<&str> = config
        .claim_header_names
        .iter()
        .map(String::as_str)
        .collect();
    assert_eq!(names, ["x-caller", "x-mail", "x_user"]);
    r.put("/mcp/auth/config", AUTH, 0, 4, 4).unwrap();
    assert_eq!(published(&mut r).claim_header_names.len(), 3);
    assert_eq!(r.delete("/mcp/auth/virtual/ops"), Ok(true));
    assert_eq!(r.delete("/mcp/auth/rules/inv"), Ok(true));
    assert!(published(&mut r).claim_header_names.is_empty());
}

#[test]
fn exchanged_services_reach_the_filter_and_get_no_injector() {
    let mut r = reg();
    r.put("/mcp/services/inv/i-1", V1, 7, 2, 2).unwrap();
    let exchange = br#"{"exchange": {"token_endpoint": "https://idp.example/token",
        "audience": "https://inv.example/mcp",
        "client": {"id": "toolgate", "secret": "env:TOOLGATE_CLIENT_SECRET"}}}"#;
    let fixed = br#"{"header": "X-Api-Key", "format": "{secret}", "secret": "env:ORDERS_KEY"}"#;
    assert_eq!(r.put("/mcp/auth/upstream/inv", exchange, 0, 3, 3), Ok(true));
    // A service not registered (yet) is named too: the filter must not call it without one.
    assert_eq!(
        r.put("/mcp/auth/upstream/later", exchange, 0, 4, 4),
        Ok(true)
    );
    assert_eq!(r.put("/mcp/auth/upstream/orders", fixed, 0, 5, 5), Ok(true));
    let config = published(&mut r);
    assert!(
        config.auth.is_none(),
        "with or without an auth configuration"
    );
    let names: Vec<&str> = config.exchanged.keys().map(String::as_str).collect();
    assert_eq!(names, ["inv", "later"]);
    assert_eq!(
        config.exchanged["inv"], config.exchanged["later"],
        "same configuration"
    );

    // Each caller's token is the filter's to add: an Envoy injector would have no secret
    // and answer 401 to every call.
    let route = |r: &mut Registry| {
        r.routing(1, Instant::now()).services["inv"]
            .credential_header
            .clone()
    };
    assert_eq!(route(&mut r), None);
    // The same service with a static credential: Envoy injects it, the filter asks nothing.
    let inv_fixed = br#"{"secret": "env:INV_TOKEN"}"#;
    assert_eq!(
        r.put("/mcp/auth/upstream/inv", inv_fixed, 0, 6, 6),
        Ok(true)
    );
    assert_eq!(route(&mut r).as_deref(), Some("authorization"));
    assert_eq!(published(&mut r).exchanged.len(), 1);
    let other = br#"{"exchange": {"token_endpoint": "https://idp.example/token",
        "audience": "https://elsewhere.example/mcp",
        "client": {"id": "toolgate", "secret": "env:TOOLGATE_CLIENT_SECRET"}}}"#;
    assert_eq!(r.put("/mcp/auth/upstream/later", other, 0, 7, 7), Ok(true));
    let changed = published(&mut r);
    assert_ne!(
        changed.exchanged["later"], config.exchanged["later"],
        "a new audience"
    );
    assert_eq!(r.delete("/mcp/auth/upstream/later"), Ok(true));
    assert!(published(&mut r).exchanged.is_empty());
}

#[test]
fn the_state_snapshot_keeps_the_auth_values() {
    let mut r = reg();
    r.put("/mcp/services/inv/i-1", V1, 7, 2, 2).unwrap();
    r.put("/mcp/auth/config", AUTH, 0, 3, 3).unwrap();
    r.put("/mcp/auth/rules/inv", READERS, 0, 4, 4).unwrap();
    r.put("/mcp/auth/virtual/default", READERS, 0, 5, 5)
        .unwrap();
    let values = r.raw_values();
    for key in [
        "/mcp/auth/config",
        "/mcp/auth/rules/inv",
        "/mcp/auth/virtual/default",
    ] {
        assert!(values.iter().any(|(k, _)| k == key), "{key}");
    }
    let mut restarted = reg();
    let read = restarted.reset(
        values
            .iter()
            // The instance's lease as etcd would give it: the fingerprint compares leases.
            .map(|(k, v)| (k.as_str(), v.as_bytes(), 7, 2, 2)),
        5,
    );
    assert!(read.rejected.is_empty(), "{:?}", read.rejected);
    assert_eq!(published(&mut restarted).auth, published(&mut r).auth);
    assert_eq!(restarted.fingerprint(), r.fingerprint());
}
