//! Latency distributions as PNG plots (cumulative distribution, log-scaled time axis), one file
//! per suite, into `bench/out/`.

use std::path::Path;
use std::sync::OnceLock;

use anyhow::{anyhow, Context};
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

/// Debian's fonts-dejavu-core (installed by `make setup`): plotters draws text with it.
const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

fn font() -> anyhow::Result<()> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        let bytes = std::fs::read(FONT).map_err(|e| format!("{FONT}: {e}"))?;
        // Registered once for the process's life.
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        register_font("sans-serif", FontStyle::Normal, bytes)
            .map_err(|_| format!("{FONT} is not a usable font"))
    })
    .clone()
    .map_err(|e| anyhow!(e))
}

/// One line per series: the share of samples at or under each latency.
pub fn cdf(path: &Path, title: &str, series: &[(String, Vec<f64>)]) -> anyhow::Result<()> {
    font()?;
    let all: Vec<f64> = series
        .iter()
        .flat_map(|(_, s)| s.iter().copied())
        .filter(|v| v.is_finite() && *v > 0.0)
        .collect();
    if all.is_empty() {
        return Ok(());
    }
    // Whole decades, so the log axis has labelled ticks.
    let lo = 10f64.powf(
        all.iter()
            .copied()
            .fold(f64::INFINITY, f64::min)
            .log10()
            .floor(),
    );
    let hi = 10f64.powf(all.iter().copied().fold(0.0, f64::max).log10().ceil());
    let root = BitMapBackend::new(path, (900, 540)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d((lo..hi).log_scale(), 0.0..1.0)?;
    chart
        .configure_mesh()
        .x_desc("latency (ms, log scale)")
        .x_labels(12)
        .x_label_formatter(&|v| {
            if *v >= 100.0 {
                format!("{v:.0}")
            } else if *v >= 1.0 {
                format!("{v:.1}")
            } else {
                format!("{v:.2}")
            }
        })
        .y_desc("share of samples at or under")
        .label_style(("sans-serif", 14))
        .draw()?;
    let colors = [BLUE, RED, GREEN, MAGENTA, CYAN, BLACK];
    for (i, (name, samples)) in series.iter().enumerate() {
        let mut sorted: Vec<f64> = samples
            .iter()
            .copied()
            .filter(|v| v.is_finite() && *v > 0.0)
            .collect();
        sorted.sort_by(|a, b| a.total_cmp(b));
        let n = sorted.len() as f64;
        let color = colors[i % colors.len()];
        chart
            .draw_series(LineSeries::new(
                sorted
                    .iter()
                    .enumerate()
                    .map(|(k, v)| (*v, (k + 1) as f64 / n)),
                color.stroke_width(2),
            ))?
            .label(format!("{name} (n={})", sorted.len()))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .position(SeriesLabelPosition::LowerRight)
        .draw()?;
    root.present()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}
