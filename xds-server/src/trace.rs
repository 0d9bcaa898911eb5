//! OpenTelemetry spans of the propagation path, exported over OTLP (gRPC) when
//! `--otlp-endpoint` is given:
//!
//! - `etcd.event`: one watch response applied to the registry (revision, events), or
//!   `health.transition` (service, instance, from, to) and `health.timeouts` (transitions),
//!   a health change that routes differently;
//! - `xds.publish`: the routing snapshot built from it, a child of that span (generation);
//! - `xds.push`: each xDS response that carries it to an Envoy, a child of that span (node,
//!   type, version, resources).
//!
//! So one trace shows an etcd change, or a health verdict, reaching every Envoy. Changes that
//! arrive while a snapshot is being built share the next one, and snapshots that follow each
//! other faster than the xDS side reads them share one version: each change's trace (up to 16
//! per snapshot, 32 per version) gets its own `xds.publish` and `xds.push` spans. Spans are created only when
//! an exporter is configured (their target is off for the log output), so without one they
//! cost nothing on the push path.

use std::time::Duration;

use anyhow::Context as _;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::filter::{EnvFilter, LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::Layer as _;

/// The target of the propagation spans: exported, never printed.
pub const TARGET: &str = "toolgate_xds::trace";

/// Where a span of the propagation path hangs: the context of the etcd event it follows.
/// Holding a context, not the span, lets the event's span end when its work does.
#[derive(Clone, Default)]
pub struct TraceParent(Option<opentelemetry::Context>);

impl std::fmt::Debug for TraceParent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "TraceParent(some)"
        } else {
            "TraceParent(none)"
        })
    }
}

impl TraceParent {
    /// The parent for work caused by `span` (none when spans are off).
    pub fn of(span: &tracing::Span) -> TraceParent {
        if span.is_disabled() {
            TraceParent(None)
        } else {
            TraceParent(Some(span.context()))
        }
    }

    /// Whether there is a span to hang work off (an exporter is configured).
    pub fn is_some(&self) -> bool {
        self.0.is_some()
    }

    /// Makes `span` a child of this parent.
    pub fn adopt(&self, span: &tracing::Span) {
        if let (Some(cx), false) = (&self.0, span.is_disabled()) {
            // Fails only for a span already started elsewhere; it then stays a root.
            let _ = span.set_parent(cx.clone());
        }
    }
}

#[cfg(test)]
impl TraceParent {
    /// A parent told apart by `label`, for tests of what keeps which trace.
    pub fn labelled(label: u32) -> TraceParent {
        TraceParent(Some(opentelemetry::Context::new().with_value(Label(label))))
    }

    /// The label of [`labelled`](Self::labelled)'s parent.
    pub fn label(&self) -> Option<u32> {
        self.0.as_ref()?.get::<Label>().map(|l| l.0)
    }
}

#[cfg(test)]
#[derive(Debug)]
struct Label(u32);

/// Installs the global subscriber: logs to stderr as `RUST_LOG` says (default `info`), and,
/// with an OTLP endpoint, the propagation spans to it. Must run inside the Tokio runtime (the
/// exporter's gRPC channel lives there). Returns the provider to flush at shutdown.
pub fn init(otlp_endpoint: Option<&str>) -> anyhow::Result<Option<SdkTracerProvider>> {
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(
            EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info".into())
                .add_directive(
                    format!("{TARGET}=off")
                        .parse()
                        .context("the log filter for trace spans")?,
                ),
        );
    let Some(endpoint) = otlp_endpoint else {
        tracing_subscriber::registry().with(logs).try_init()?;
        return Ok(None);
    };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .with_timeout(Duration::from_secs(5))
        .build()
        .with_context(|| format!("the OTLP exporter for --otlp-endpoint {endpoint}"))?;
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name("toolgate-xds")
                .build(),
        )
        .build();
    let spans = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("toolgate-xds"))
        .with_filter(Targets::new().with_target(TARGET, LevelFilter::INFO));
    tracing_subscriber::registry()
        .with(logs)
        .with(spans)
        .try_init()?;
    Ok(Some(provider))
}
