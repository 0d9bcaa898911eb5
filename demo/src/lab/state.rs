//! What the lab shares between its fault layer, its MCP tools and its
//! control API: identity, knobs and call counters.

use std::{
    collections::BTreeMap,
    sync::{Mutex, MutexGuard, PoisonError},
    time::Duration,
};

use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use super::knobs::{FailureMode, KnobError, Knobs, Layer};
use crate::mcp::TransportOptions;

pub struct LabState {
    pub instance_id: String,
    pub tools: Vec<String>,
    pub transport: TransportOptions,
    /// Cancelled on SIGTERM/SIGINT; releases requests parked by `hang`.
    pub shutdown: CancellationToken,
    knobs: Mutex<Knobs>,
    calls: Mutex<BTreeMap<String, u64>>,
}

/// The data behind these locks stays consistent whatever a panicking holder
/// did (each update is a single assignment), so a poisoned lock is still usable.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl LabState {
    pub fn new(
        instance_id: String,
        tools: Vec<String>,
        knobs: Knobs,
        transport: TransportOptions,
        shutdown: CancellationToken,
    ) -> Self {
        let calls = tools.iter().map(|tool| (tool.clone(), 0)).collect();
        Self {
            instance_id,
            tools,
            transport,
            shutdown,
            knobs: Mutex::new(knobs),
            calls: Mutex::new(calls),
        }
    }

    pub fn serves(&self, tool: &str) -> bool {
        self.tools.iter().any(|served| served == tool)
    }

    pub fn knobs(&self) -> Knobs {
        lock(&self.knobs).clone()
    }

    pub fn update_knobs(&self, patch: &Value) -> Result<(), KnobError> {
        lock(&self.knobs).apply(patch)
    }

    pub fn health_fail(&self) -> bool {
        lock(&self.knobs).health_fail
    }

    pub fn latency_for(&self, tool: &str) -> Duration {
        lock(&self.knobs).latency_for(tool)
    }

    /// Decides whether this call to `tool` fails at `layer`: its mode must
    /// belong there, and the `fail_rate` draw must say so.
    pub fn draw_failure(&self, tool: &str, layer: Layer) -> Option<FailureMode> {
        let knobs = lock(&self.knobs);
        let mode = knobs.mode_for(tool);
        if mode.layer() != Some(layer) {
            return None;
        }
        // random() is in [0, 1), so a rate of 1.0 always fails and 0.0 never does.
        (rand::random::<f64>() < knobs.fail_rate).then_some(mode)
    }

    /// Counts a `tools/call` as received, whatever happens to it next. Names
    /// the lab does not serve are counted too: the call still reached it.
    pub fn record_call(&self, tool: &str) {
        *lock(&self.calls).entry(tool.to_owned()).or_default() += 1;
    }

    pub fn reset_counters(&self) {
        let mut calls = lock(&self.calls);
        calls.retain(|tool, _| self.tools.contains(tool));
        calls.values_mut().for_each(|count| *count = 0);
    }

    /// The `GET /control` document.
    pub fn snapshot(&self) -> Value {
        let calls = lock(&self.calls).clone();
        let total_calls: u64 = calls.values().sum();
        json!({
            "instance_id": self.instance_id,
            "tools": self.tools,
            "transport": self.transport,
            "knobs": self.knobs(),
            "calls": calls,
            "total_calls": total_calls,
        })
    }
}
