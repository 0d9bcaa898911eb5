//! Where the binaries under test live.

use std::net::TcpListener;
use std::path::PathBuf;

/// The workspace root (the parent of this crate).
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// A binary of this workspace, built by `make build` into the same profile as the tests.
pub fn project_bin(name: &str) -> PathBuf {
    // Test executables live in target/<profile>/deps/, binaries (the bench too) in
    // target/<profile>/.
    let dir = std::env::current_exe()
        .ok()
        .and_then(|exe| {
            let dir = exe.parent()?;
            Some(if dir.ends_with("deps") {
                dir.parent()?.to_path_buf()
            } else {
                dir.to_path_buf()
            })
        })
        .unwrap_or_else(|| workspace_root().join("target/release"));
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: run `make build` (or `cargo build --release --workspace --bins`) first",
        path.display()
    );
    path
}

/// envoy, etcd, etcdctl: linked by `make setup` from the pinned wheels in .venv.
pub fn tool_bin(name: &str) -> PathBuf {
    let path = workspace_root().join(".venv/toolgate-bin").join(name);
    assert!(
        path.exists(),
        "{} is missing: run `make setup` first",
        path.display()
    );
    path
}

/// A port that was free a moment ago on 127.0.0.1. The OS does not hand out the same
/// ephemeral port again right away, so collisions between parallel tests are rare.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding 127.0.0.1:0 to find a free port")
}

/// The toolgate wasm filter, built by `make build` for wasm32-wasip1.
pub fn filter_wasm() -> PathBuf {
    let path = workspace_root().join("target/wasm32-wasip1/release/toolgate_filter.wasm");
    assert!(
        path.exists(),
        "{} is missing: run `make build` first",
        path.display()
    );
    path
}
