//! `toolgate-bench`: runs the benchmark suites on real processes on loopback and prints one
//! markdown table; `--json` writes the figures to a file too.

mod propagation;
mod stats;

use std::path::PathBuf;

use clap::Parser;
use toolgate_tests::TestEnv;

#[derive(Parser, Debug)]
#[command(
    name = "toolgate-bench",
    about = "toolgate's speed figures, measured side by side in one run"
)]
struct Args {
    /// Instance counts for the propagation suite.
    #[arg(long, value_delimiter = ',', default_value = "1000")]
    instances: Vec<usize>,
    /// Single changes measured per instance count.
    #[arg(long, default_value_t = 200)]
    changes: usize,
    /// Where to write the figures as JSON.
    #[arg(long, default_value = "bench/results.json")]
    json: PathBuf,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut results = Vec::new();
    for &n in &args.instances {
        eprintln!("propagation with {n} instances ...");
        let env = TestEnv::new(&format!("bench_propagation_{n}"));
        results.push(propagation::run(&env, n, args.changes).await?);
    }
    println!("| suite | instances | etcd put->watch p50 / p99 (floor) | add p50 / p99 / max | remove p50 / p99 / max | burst of 45 |");
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    for r in &results {
        println!(
            "| propagation | {} | {:.2} / {:.2} ms | {:.2} / {:.2} / {:.2} ms | {:.2} / {:.2} / {:.2} ms | {:.1} ms |",
            r.instances,
            r.etcd_floor.p50_ms,
            r.etcd_floor.p99_ms,
            r.add.p50_ms,
            r.add.p99_ms,
            r.add.max_ms,
            r.remove.p50_ms,
            r.remove.p99_ms,
            r.remove.max_ms,
            r.burst_45_ms
        );
    }
    if let Some(dir) = args.json.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(
        &args.json,
        serde_json::to_string_pretty(&serde_json::json!({"propagation": results}))?,
    )?;
    Ok(())
}
