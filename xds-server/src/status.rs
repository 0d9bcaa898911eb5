//! `toolgate-xds status`: the operator's view of one toolgate-xds, as readable tables, from
//! its admin API.

use serde_json::Value;

/// Renders rows under a header with columns padded to their widest cell.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(cell.chars().count());
            }
        }
    }
    let line = |cells: Vec<&str>| {
        let mut out = String::new();
        for (i, cell) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                out.push_str(cell);
            } else {
                let pad = widths[i] - cell.chars().count();
                out.push_str(cell);
                out.push_str(&" ".repeat(pad + 2));
            }
        }
        out.trim_end().to_string() + "\n"
    };
    let mut out = line(header.to_vec());
    if rows.is_empty() {
        out.push_str("(none)\n");
    }
    for row in rows {
        out.push_str(&line(row.iter().map(String::as_str).collect()));
    }
    out
}

fn s(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}

/// The whole report from the three admin documents.
pub fn render(admin: &str, registry: &Value, breakers: &Value, overrides: &Value) -> String {
    let mut out = String::new();
    let etcd = if registry["etcd_up"] == true {
        "etcd reachable".to_string()
    } else {
        "ETCD UNREACHABLE: serving the last known state".to_string()
    };
    out.push_str(&format!(
        "toolgate-xds at {admin}: {etcd}, revision {}, {} instances\n\n",
        s(&registry["revision"]),
        s(&registry["instances"])
    ));
    let mut rows = Vec::new();
    if let Some(services) = registry["services"].as_object() {
        for (service, instances) in services {
            let list = instances.as_array().cloned().unwrap_or_default();
            if list.is_empty() {
                rows.push(vec![
                    service.clone(),
                    "-".into(),
                    "-".into(),
                    "NO INSTANCES".into(),
                    "-".into(),
                    "-".into(),
                    "-".into(),
                ]);
            }
            for i in list {
                let calls = &i["calls"];
                let total = calls
                    .as_object()
                    .map(|c| c.values().filter_map(Value::as_u64).sum::<u64>())
                    .unwrap_or(0);
                let failing = if total == 0 {
                    "-".to_string()
                } else {
                    format!(
                        "{:.0}% of {total}",
                        i["call_failure_rate"].as_f64().unwrap_or(0.0) * 100.0
                    )
                };
                rows.push(vec![
                    service.clone(),
                    s(&i["instance_id"]),
                    s(&i["endpoint"]),
                    s(&i["state"]),
                    last_probe(&i),
                    failing,
                    format!("{} since {}", s(&i["cause"]), s(&i["since"])),
                ]);
            }
        }
    }
    out.push_str(&table(
        &[
            "SERVICE",
            "INSTANCE",
            "ENDPOINT",
            "STATE",
            "LAST PROBE",
            "CALLS FAILING",
            "WHY",
        ],
        &rows,
    ));
    out.push_str("\nOPEN BREAKERS (fleet)\n");
    let rows: Vec<Vec<String>> = breakers["breakers"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|b| {
            vec![
                s(&b["service"]),
                s(&b["tool"]),
                s(&b["state"]),
                format!("{:.1}s", b["remaining_ms"].as_f64().unwrap_or(0.0) / 1000.0),
                s(&b["opened_by"]),
            ]
        })
        .collect();
    out.push_str(&table(
        &["SERVICE", "TOOL", "STATE", "REMAINING", "OPENED BY"],
        &rows,
    ));
    out.push_str("\nOVERRIDES\n");
    let rows: Vec<Vec<String>> = overrides["overrides"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|o| {
            vec![
                s(&o["service"]),
                s(&o["tool"]),
                s(&o["mode"]),
                s(&o["author"]),
                s(&o["since"]),
                s(&o["reason"]),
            ]
        })
        .collect();
    out.push_str(&table(
        &["SERVICE", "TOOL", "MODE", "AUTHOR", "SINCE", "REASON"],
        &rows,
    ));
    out
}

/// The auth section from `GET /v1/auth`: whether a configuration exists and its issuers,
/// then which services and virtual servers require a token, and how many rules each has.
pub fn render_auth(auth: &Value) -> String {
    let mut out = String::new();
    if auth["configured"] == true {
        let config = &auth["config"];
        let issuers: Vec<String> = config["issuers"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|i| {
                let keys = match &i["jwks"] {
                    j if j.get("remote").is_some() => {
                        format!("keys from {}", s(&j["remote"]["uri"]))
                    }
                    _ => "inline keys".to_string(),
                };
                format!("{} ({keys})", s(&i["issuer"]))
            })
            .collect();
        out.push_str(&format!(
            "\nAUTH: configured for {}; issuers: {}\n",
            s(&config["resource"]),
            if issuers.is_empty() {
                "-".to_string()
            } else {
                issuers.join(", ")
            }
        ));
    } else {
        out.push_str("\nAUTH: not configured (no service requires a token)\n");
        if auth["rules_unused"] == true {
            out.push_str("rule sets are stored but not applied until a configuration is\n");
        }
    }
    for (section, header, exists) in [
        ("services", "SERVICE", "registered"),
        ("virtual_servers", "VIRTUAL SERVER", "defined"),
    ] {
        let rows: Vec<Vec<String>> = auth[section]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(name, e)| {
                let rules = match e["rules"]["rules"].as_array() {
                    Some(r) if r.len() == 1 => "1 rule".to_string(),
                    Some(r) => format!("{} rules", r.len()),
                    None => "-".to_string(),
                };
                let name = if e[exists] == false {
                    format!("{name} (not {exists})")
                } else {
                    name.clone()
                };
                let token = if e["requires_token"] == true {
                    "required"
                } else {
                    "-"
                };
                vec![name, token.to_string(), rules]
            })
            .collect();
        if section == "virtual_servers" {
            out.push('\n');
        }
        out.push_str(&table(&[header, "TOKEN", "RULES"], &rows));
    }
    out
}

/// The limits section from `GET /v1/limits`: each rule in force, then the callers limits
/// refused most in the last ten minutes.
pub fn render_limits(limits: &Value) -> String {
    let rows: Vec<Vec<String>> = limits["limits"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|l| {
            let tool = l["tool"].as_str().unwrap_or("*").to_string();
            let service = s(&l["service"]);
            l["rules"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .map(move |r| {
                    vec![
                        service.clone(),
                        tool.clone(),
                        s(&r["label"]),
                        s(&r["per"]),
                        format!("{}/{}s", s(&r["calls"]), s(&r["per_seconds"])),
                        r.get("burst").map(s).unwrap_or_else(|| s(&r["calls"])),
                    ]
                })
        })
        .collect();
    let mut out = String::from("\nLIMITS\n");
    if rows.is_empty() {
        out.push_str("none\n");
        return out;
    }
    out.push_str(&table(
        &["SERVICE", "TOOL", "RULE", "PER", "RATE", "BURST"],
        &rows,
    ));
    let top: Vec<Vec<String>> = limits["top_limited"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| {
            vec![
                s(&t["caller"]),
                format!("{}/{}", s(&t["service"]), s(&t["tool"])),
                s(&t["rule"]),
                s(&t["refused"]),
                format!("{}s ago", s(&t["last_ago_secs"])),
            ]
        })
        .collect();
    out.push_str("\nMOST LIMITED (last 10 minutes)\n");
    if top.is_empty() {
        out.push_str("nobody\n");
    } else {
        out.push_str(&table(&["CALLER", "TOOL", "RULE", "REFUSED", "LAST"], &top));
    }
    out
}

/// The probe kind and its last result: `mcp ok`, or `http failed: HTTP 404 on GET /health: …`.
fn last_probe(instance: &Value) -> String {
    let kind = instance["probe"].as_str().unwrap_or("http");
    match instance["probes"].as_array().and_then(|p| p.last()) {
        None => format!("{kind} -"),
        Some(p) if p["ok"].as_bool() == Some(true) => format!("{kind} ok"),
        Some(p) => format!("{kind} failed: {}", s(&p["detail"])),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn renders_states_breakers_and_overrides_as_aligned_tables() {
        let reg = json!({"etcd_up": false, "revision": 7, "instances": 1, "services": {
            "inv": [{"instance_id": "inv-1", "endpoint": "127.0.0.1:1", "state": "SUSPECT",
                     "cause": "2 probes failed", "since": "t", "calls": {"ok": 3, "http_5xx": 1},
                     "call_failure_rate": 0.25, "probe": "mcp", "probes": [{"ok": false,
                     "detail": "MCP at /mcp: ping: HTTP 500"}]}],
            "empty": []}});
        let br = json!({"breakers": [{"service": "inv", "tool": "read", "state": "open",
            "remaining_ms": 1500, "opened_by": "gw-a"}]});
        let ov = json!({"overrides": []});
        let out = render("http://x", &reg, &br, &ov);
        assert!(out.contains("ETCD UNREACHABLE"), "{out}");
        assert!(out.contains("inv      inv-1"), "{out}");
        assert!(out.contains("SUSPECT"), "{out}");
        assert!(out.contains("25% of 4"), "{out}");
        assert!(
            out.contains("mcp failed: MCP at /mcp: ping: HTTP 500"),
            "{out}"
        );
        assert!(out.contains("NO INSTANCES"), "{out}");
        assert!(out.contains("1.5s"), "{out}");
        assert!(out.contains("OVERRIDES\nSERVICE"), "{out}");
        assert!(out.ends_with("(none)\n"), "{out}");
    }

    #[test]
    fn renders_the_limits_and_who_they_refuse_most() {
        let out = render_limits(&json!({
            "limits": [{"service": "orders", "tool": null, "rules": [
                {"per": "subject", "calls": 60, "per_seconds": 60, "burst": 10, "label": "subject-60-per-60s"}]}],
            "top_limited": [{"service": "orders", "tool": "*", "rule": "subject-60-per-60s",
                "caller": "subject:alice", "refused": 42, "last_ago_secs": 3}]
        }));
        assert!(out.contains("subject-60-per-60s"), "{out}");
        assert!(out.contains("60/60s"), "{out}");
        assert!(out.contains("subject:alice"), "{out}");
        assert!(out.contains("42"), "{out}");
        assert!(render_limits(&json!({"limits": []})).contains("none"));
    }

    #[test]
    fn renders_who_requires_a_token() {
        let auth = json!({"configured": true, "rules_unused": false,
            "config": {"resource": "http://gw", "issuers": [
                {"issuer": "http://idp", "jwks": {"remote": {"uri": "http://idp/jwks"}}},
                {"issuer": "local", "jwks": {"inline": {"keys": [{}]}}}]},
            "services": {
                "inv": {"registered": true, "requires_token": true,
                        "rules": {"rules": [{"tools": ["*"]}, {"tools": ["a"]}]}},
                "later": {"registered": false, "requires_token": true,
                          "rules": {"rules": [{"tools": ["*"]}]}},
                "open": {"registered": true, "requires_token": false, "rules": null}},
            "virtual_servers": {"default": {"defined": true, "requires_token": false,
                                            "rules": null}}});
        let out = render_auth(&auth);
        assert!(
            out.contains(
                "AUTH: configured for http://gw; issuers: http://idp (keys from \
                          http://idp/jwks), local (inline keys)"
            ),
            "{out}"
        );
        assert!(
            out.contains("inv                     required  2 rules"),
            "{out}"
        );
        assert!(
            out.contains("later (not registered)  required  1 rule"),
            "{out}"
        );
        assert!(out.contains("open"), "{out}");
        assert!(
            out.contains("-\n\nVIRTUAL SERVER  TOKEN  RULES\ndefault"),
            "{out}"
        );
        let out = render_auth(&json!({"configured": false, "rules_unused": true,
            "config": null, "services": {}, "virtual_servers": {}}));
        assert!(out.contains("AUTH: not configured"), "{out}");
        assert!(out.contains("not applied"), "{out}");
    }
}
