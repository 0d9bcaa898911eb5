//! Property tests of what toolgate-xds reads from etcd: instance metadata and policies. Any
//! bytes are refused or admitted without a panic, and whatever is admitted is valid and reads
//! back the same after being written out.
//!
//! `TOOLGATE_FUZZ_CASES` sets the cases per property (`make fuzz-smoke` and `make fuzz` raise
//! it; the default keeps `make test` quick).

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use serde_json::{json, Value};
use toolgate_model::policy::{FilterConfig, PolicyOverrides};
use toolgate_model::InstanceMetadata;

/// A property that never sees an admitted value tests only the refusals.
#[test]
fn the_generators_produce_admitted_values_too() {
    let mut runner = proptest::test_runner::TestRunner::default();
    let mut admitted = (0, 0);
    for _ in 0..500 {
        let body = bytes().new_tree(&mut runner).expect("value").current();
        admitted.0 += u32::from(InstanceMetadata::from_json(&body).is_ok());
        admitted.1 += u32::from(FilterConfig::from_json(&body).is_ok());
    }
    assert!(
        admitted.0 > 20 && admitted.1 > 20,
        "admitted (metadata, configs) of 500: {admitted:?}"
    );
}

fn cases() -> u32 {
    std::env::var("TOOLGATE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000)
}

/// JSON values of a few levels with the keys the readers know, and some they do not.
fn value() -> impl Strategy<Value = Value> {
    let key = prop::sample::select(vec![
        "instance_id",
        "endpoint",
        "tools",
        "weight",
        "mcp_path",
        "health_path",
        "version",
        "zone",
        "labels",
        "failure_rate_threshold",
        "min_calls",
        "open_ms",
        "timeout_ms",
        "fallback_tool",
        "count_is_error",
        "max_connections",
        "defaults",
        "services",
        "policy",
        "max_body_bytes",
        "max_json_depth",
        "x",
        "",
    ])
    .prop_map(str::to_string);
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u32>().prop_map(|n| json!(n)),
        any::<f64>().prop_map(|f| json!(f)),
        ".{0,24}".prop_map(Value::String),
        prop::sample::select(vec![
            "127.0.0.1:8080",
            "[::1]:9",
            "0.0.0.0:1",
            "169.254.169.254:80",
            "host:1",
            "1.2.3.4:0",
            "/mcp",
            "tool_a",
            "a b",
        ])
        .prop_map(|s| Value::String(s.into())),
    ];
    leaf.prop_recursive(4, 48, 8, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(key.clone(), inner, 0..8)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Registrations close to valid ones, so the admitted path is exercised too: a real id and
/// endpoint, and the other fields from anywhere.
fn metadata_like() -> impl Strategy<Value = Value> {
    (
        "[a-z0-9._-]{1,12}",
        prop::sample::select(vec!["127.0.0.1:8080", "[::1]:9", "10.0.0.7:443", "0.0.0.0:1", "x:1"]),
        prop::collection::vec("[a-z_]{1,8}|.{0,4}", 0..4),
        any::<u32>(),
        prop::option::of(value()),
    )
        .prop_map(|(id, endpoint, tools, weight, extra)| {
            let mut v = json!({"instance_id": id, "endpoint": endpoint, "tools": tools, "weight": weight % 200});
            if let (Some(Value::Object(extra)), Some(obj)) = (extra, v.as_object_mut()) {
                for (k, x) in extra {
                    if k != "instance_id" && k != "endpoint" {
                        obj.insert(k, x);
                    }
                }
            }
            v
        })
}

/// Policies close to valid ones: known fields with numbers from anywhere.
fn policy_like() -> impl Strategy<Value = Value> {
    (
        prop::option::of(0u64..200),
        prop::option::of(0u64..100_000),
        prop::option::of("[a-z]{1,8}"),
        prop::option::of(0u64..200),
    )
        .prop_map(|(rate, open_ms, svc, depth)| {
            let mut policy = serde_json::Map::new();
            if let Some(r) = rate {
                policy.insert("failure_rate_threshold".into(), json!(r));
            }
            if let Some(o) = open_ms {
                policy.insert("open_ms".into(), json!(o));
            }
            let mut config = json!({"defaults": {}});
            if let Some(s) = svc {
                config["services"] = json!({ s: { "policy": Value::Object(policy) } });
            }
            if let Some(d) = depth {
                config["max_json_depth"] = json!(d);
            }
            config
        })
}

fn bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..256),
        value().prop_map(|v| v.to_string().into_bytes()),
        metadata_like().prop_map(|v| v.to_string().into_bytes()),
        policy_like().prop_map(|v| v.to_string().into_bytes()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn metadata_is_refused_or_valid_and_round_trips(body in bytes()) {
        if let Ok(meta) = InstanceMetadata::from_json(&body) {
            prop_assert!(meta.validate().is_ok());
            let again = InstanceMetadata::from_json(meta.to_json().as_bytes());
            prop_assert_eq!(again.ok(), Some(meta));
        }
    }

    #[test]
    fn policy_filter_configs_are_refused_or_yield_valid(body in bytes(), tool in ".{0,12}") {
        if let Ok(config) = FilterConfig::from_json(&body) {
            for service in config.services.keys().chain(std::iter::once(&String::new())) {
                prop_assert!(config.policy_for(service, &tool).validate().is_ok());
            }
            let again = FilterConfig::from_json(serde_json::to_string(&config).unwrap_or_default().as_bytes());
            prop_assert_eq!(again.ok(), Some(config));
        }
    }

    #[test]
    fn policy_overrides_never_panic(body in bytes()) {
        let _ = serde_json::from_slice::<PolicyOverrides>(&body);
    }
}
