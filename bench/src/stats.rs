//! Percentiles of a sample of durations.

use std::time::Duration;

use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub n: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
}

/// Nearest-rank percentiles (no interpolation: every figure is a measured value).
pub fn summarize(samples: &[Duration]) -> Summary {
    let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    ms.sort_by(|a, b| a.total_cmp(b));
    let rank = |p: f64| -> f64 {
        if ms.is_empty() {
            return f64::NAN;
        }
        let idx = ((p * ms.len() as f64).ceil() as usize).clamp(1, ms.len()) - 1;
        ms[idx]
    };
    Summary {
        n: ms.len(),
        p50_ms: rank(0.50),
        p99_ms: rank(0.99),
        max_ms: ms.last().copied().unwrap_or(f64::NAN),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let s: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        let sum = summarize(&s);
        assert_eq!((sum.p50_ms, sum.p99_ms, sum.max_ms), (50.0, 99.0, 100.0));
    }
}
