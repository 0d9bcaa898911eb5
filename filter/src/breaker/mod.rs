//! Per-(service, tool) circuit breakers, kept in proxy-wasm shared data so that every worker
//! of an Envoy sees one breaker per tool.
//!
//! `window` counts calls in a sliding window of buckets, `state` is the CLOSED / OPEN /
//! HALF_OPEN machine over one shared record, `store` reads and writes those records and
//! keeps each worker's unflushed counts. Time, randomness and shared data are injected, so
//! all of it runs natively in tests.

pub mod state;
pub mod store;
pub mod window;

#[cfg(test)]
mod tests;

pub use state::{Admission, Breaker, Cause, Force, Limits, Outcome, State, Transition};
pub use store::{
    breaker_key, parse_breaker_key, Breakers, CasMismatch, HostError, MemStore, Record,
    SharedStore, StoreStats, CREATE_CAS,
};
pub use window::{Counts, Window};
