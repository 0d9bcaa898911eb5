//! Percentiles of a sample of durations, and the median and spread of a few repetitions.

use std::time::Duration;

use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// Every sample, in ms, for the plots (not written to the JSON).
    #[serde(skip)]
    pub samples_ms: Vec<f64>,
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
        samples_ms: ms.clone(),
        n: ms.len(),
        p50_ms: rank(0.50),
        p99_ms: rank(0.99),
        max_ms: ms.last().copied().unwrap_or(f64::NAN),
    }
}

/// The median of a few repetitions of one figure and its range.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

/// Median (the mean of the two middle values for an even count) with min and max.
pub fn spread(values: &[f64]) -> Spread {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| !x.is_nan()).collect();
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return Spread {
            median: f64::NAN,
            min: f64::NAN,
            max: f64::NAN,
        };
    }
    let mid = v.len() / 2;
    let median = if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    };
    Spread {
        median,
        min: v[0],
        max: v[v.len() - 1],
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

    #[test]
    fn median_and_range() {
        let s = spread(&[3.0, 1.0, 2.0, 10.0, 4.0]);
        assert_eq!((s.median, s.min, s.max), (3.0, 1.0, 10.0));
        let s = spread(&[4.0, 2.0]);
        assert_eq!((s.median, s.min, s.max), (3.0, 2.0, 4.0));
        assert!(spread(&[]).median.is_nan());
    }
}
