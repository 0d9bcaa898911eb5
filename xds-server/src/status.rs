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
}
