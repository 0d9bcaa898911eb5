//! toolgate-xds exports OpenTelemetry spans over OTLP: an etcd change (`etcd.event`) and the
//! xDS pushes it causes (`xds.push`, one per Envoy and type) land in one trace, received by a
//! real OTLP/gRPC collector endpoint.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::trace::v1::Span;
use toolgate_tests::{Envoy, Etcd, Member, TestEnv, Xds};

#[derive(Clone, Default)]
struct Collector {
    spans: Arc<Mutex<Vec<Span>>>,
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock().unwrap_or_else(|p| p.into_inner());
        for rs in request.into_inner().resource_spans {
            for ss in rs.scope_spans {
                spans.extend(ss.spans);
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

fn attribute(span: &Span, key: &str) -> String {
    use opentelemetry_proto::tonic::common::v1::any_value::Value;
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref()?.value.as_ref())
        .map(|v| match v {
            Value::StringValue(s) => s.clone(),
            Value::IntValue(i) => i.to_string(),
            other => format!("{other:?}"),
        })
        .unwrap_or_default()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test]
async fn an_etcd_change_and_its_pushes_are_one_trace() {
    let env = TestEnv::new("tracing");
    let collector = Collector::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("binding the collector");
    let addr = listener.local_addr().expect("collector address");
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(collector.clone()))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );

    let etcd = Etcd::start(&env).await;
    let otlp = format!("http://{addr}");
    let xds = Xds::start_with_env(
        &env,
        "xds",
        &etcd.endpoint(),
        &["--otlp-endpoint", &otlp],
        // Batches go out every 100 ms instead of 5 s.
        &[("OTEL_BSP_SCHEDULE_DELAY", "100")],
    )
    .await;
    let envoy = Envoy::start(&env, "envoy", &xds).await;
    let member = Member::start(&env, &etcd.endpoint(), "orders", "orders-1", &[], 10).await;
    toolgate_tests::wait_until(
        "envoy routes to orders-1",
        Duration::from_secs(20),
        || async { envoy.addresses("orders").await == vec![member.server.endpoint()] },
    )
    .await;

    // The registration's etcd event: the new service's CDS push to this Envoy is in its
    // trace. The instance's first probe then makes it UP: the EDS push that routes to it is
    // in that transition's trace.
    let started = std::time::Instant::now();
    let (event, publish, cds, transition, eds) = loop {
        let spans = collector
            .spans
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let child = |root: &Span, name: &str, extra: &dyn Fn(&Span) -> bool| {
            spans
                .iter()
                .find(|s| {
                    s.name == name
                        && s.trace_id == root.trace_id
                        && s.parent_span_id == root.span_id
                        && extra(s)
                })
                .cloned()
        };
        let to_envoy = |ty: &'static str| {
            move |s: &Span| attribute(s, "node") == "envoy" && attribute(s, "type") == ty
        };
        let from_etcd = spans
            .iter()
            .filter(|s| s.name == "etcd.event")
            .find_map(|e| {
                Some((
                    e.clone(),
                    child(e, "xds.publish", &|_| true)?,
                    child(e, "xds.push", &to_envoy("cds"))?,
                ))
            });
        let from_health = spans
            .iter()
            .filter(|s| {
                s.name == "health.transition"
                    && attribute(s, "instance") == "orders-1"
                    && attribute(s, "to") == "UP"
            })
            .find_map(|t| Some((t.clone(), child(t, "xds.push", &to_envoy("eds"))?)));
        if let (Some((e, p, c)), Some((t, d))) = (from_etcd, from_health) {
            break (e, p, c, t, d);
        }
        if started.elapsed() > Duration::from_secs(20) {
            let seen: Vec<String> = spans
                .iter()
                .map(|s| {
                    format!(
                        "{} trace={} span={} parent={} node={} type={}",
                        s.name,
                        hex(&s.trace_id),
                        hex(&s.span_id),
                        hex(&s.parent_span_id),
                        attribute(s, "node"),
                        attribute(s, "type")
                    )
                })
                .collect();
            panic!(
                "the traces are incomplete after 20 s; the collector got {} spans:\n{}",
                seen.len(),
                seen.join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(!attribute(&event, "revision").is_empty(), "{event:?}");
    assert!(attribute(&event, "events").parse::<u64>().unwrap_or(0) >= 1);
    assert!(!attribute(&publish, "generation").is_empty(), "{publish:?}");
    assert!(!attribute(&cds, "version").is_empty(), "{cds:?}");
    assert!(cds.start_time_unix_nano >= event.start_time_unix_nano);
    assert_eq!(attribute(&transition, "service"), "orders");
    assert!(eds.start_time_unix_nano >= transition.start_time_unix_nano);
    server.abort();
}
