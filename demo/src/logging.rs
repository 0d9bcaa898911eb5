//! Logs go to stderr so stdout stays free for the one `listening on` line
//! that test harnesses wait for.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber; `RUST_LOG` overrides the default `info`.
pub fn init() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour codes would litter the log files harnesses redirect stderr to.
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}
