//! The only code that talks to proxy-wasm: Envoy's callbacks in, host calls out. Every decision
//! is made by the plain modules; this glue is split by concern:
//! - `root.rs`: the root context, its configuration and the fleet's state laid over the
//!   breakers, the tick that flushes counts and call feedback;
//! - `events.rs`: breaker events from HTTP contexts to toolgate-xds, over a shared queue, with
//!   resends until acknowledged;
//! - `stream.rs`: one HTTP stream, forwarded to [`crate::call::Call`].

mod events;
mod root;
mod stream;

use std::time::UNIX_EPOCH;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::RootContext;
use proxy_wasm::types::{LogLevel, MetricType, Status};

use crate::breaker::{CasMismatch, HostError, Record, SharedStore};
use crate::call::Shared;
use crate::stats::{MetricHost, MetricKind};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    std::panic::set_hook(Box::new(|info| {
        let _ = hostcalls::log(LogLevel::Critical, &format!("toolgate filter panicked: {info}"));
    }));
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(root::Root::new()) });
}}

/// The state every HTTP context of this worker VM shares.
type HostShared = Shared<HostStore, HostMetrics>;

/// proxy-wasm shared data: one store for every worker VM of this Envoy.
struct HostStore;

impl SharedStore for HostStore {
    fn get(&self, key: &str) -> Result<Option<Record>, HostError> {
        match hostcalls::get_shared_data(key) {
            Ok((Some(bytes), Some(cas))) => Ok(Some((bytes, cas))),
            // The SDK maps Envoy's NotFound to (None, None).
            Ok((None, _)) => Ok(None),
            Ok((Some(_), None)) | Err(_) => Err(HostError),
        }
    }

    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> Result<(), CasMismatch> {
        match hostcalls::set_shared_data(key, Some(value), cas) {
            Ok(()) => Ok(()),
            Err(Status::CasMismatch) => Err(CasMismatch),
            // Other errors are the host's; treat as a lost race so the write is retried later.
            Err(_) => Err(CasMismatch),
        }
    }
}

/// proxy-wasm metrics; Envoy names them `wasmcustom.<name>`.
struct HostMetrics;

impl MetricHost for HostMetrics {
    fn define(&self, kind: MetricKind, name: &str) -> Option<u32> {
        let kind = match kind {
            MetricKind::Counter => MetricType::Counter,
            MetricKind::Gauge => MetricType::Gauge,
        };
        hostcalls::define_metric(kind, name).ok()
    }

    fn increment(&self, id: u32, by: u64) {
        let _ = hostcalls::increment_metric(id, i64::try_from(by).unwrap_or(i64::MAX));
    }

    fn record(&self, id: u32, value: u64) {
        let _ = hostcalls::record_metric(id, value);
    }
}

fn now_ms() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Nanoseconds of the wall clock: a seed that differs per VM and per root context.
fn seed() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1)
}

fn log(level: LogLevel, message: &str) {
    let _ = hostcalls::log(level, message);
}
