//! Where the binaries under test live.

use std::collections::BTreeSet;
use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::Mutex;

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

/// `.venv/bin/python`, where `make setup` installs the official Python MCP SDK.
pub fn python_bin() -> PathBuf {
    let path = workspace_root().join(".venv/bin/python");
    assert!(
        path.exists(),
        "{} is missing: run `make setup` first",
        path.display()
    );
    path
}

/// `dist/index.js` of `@modelcontextprotocol/server-everything`, the reference MCP server, as
/// `make setup` installs it into `tests/node/node_modules` (pinned by tests/node/package.json).
/// Run it as `node --import <loopback_preload()> <this> streamableHttp` with `PORT` set.
pub fn everything_server() -> PathBuf {
    let path = workspace_root()
        .join("tests/node/node_modules/@modelcontextprotocol/server-everything/dist/index.js");
    assert!(
        path.exists(),
        "{} is missing: run `make setup` first",
        path.display()
    );
    path
}

/// `dist/index.js` of a reference server that `make setup` installs into
/// `tests/node/node_modules` (pinned by tests/node/package.json).
fn node_server(package: &str) -> PathBuf {
    let path = workspace_root().join(format!(
        "tests/node/node_modules/@modelcontextprotocol/{package}/dist/index.js"
    ));
    assert!(
        path.exists(),
        "{} is missing: run `make setup` first",
        path.display()
    );
    path
}

/// The official MCP conformance suite's command line (`@modelcontextprotocol/conformance`),
/// run as `node <this> server --url <url> -o <dir>`.
pub fn conformance_cli() -> PathBuf {
    node_server("conformance")
}

/// `@modelcontextprotocol/server-memory`, a stdio server (a knowledge graph kept in the file
/// `MEMORY_FILE_PATH` names). Run it as `node <this>`.
pub fn memory_server() -> PathBuf {
    node_server("server-memory")
}

/// `@modelcontextprotocol/server-filesystem`, a stdio server. Run it as
/// `node <this> <allowed directory>...`.
pub fn filesystem_server() -> PathBuf {
    node_server("server-filesystem")
}

/// `tests/node/loopback.mjs`: a Node preload (`node --import`) that turns a listen on every
/// interface into one on 127.0.0.1, for servers such as the everything-server that bind all
/// interfaces and take no host setting.
pub fn loopback_preload() -> PathBuf {
    workspace_root().join("tests/node/loopback.mjs")
}

/// A port that was free a moment ago on 127.0.0.1, for a process to listen on.
///
/// Taken below the kernel's ephemeral range: ports from `bind(0)` are ephemeral ports, which
/// every outgoing connection of every parallel test also draws from, so one could take the
/// port between this call and the process binding it (CI saw an Envoy fail on "Address
/// already in use" that way). A port is never handed out twice by one test binary.
pub fn free_port() -> u16 {
    static GIVEN: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    let ephemeral_from = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    const FROM: u16 = 10_000;
    let mut given = GIVEN.lock().unwrap_or_else(|p| p.into_inner());
    if ephemeral_from > FROM + 1000 {
        for _ in 0..1000 {
            let port = rand::random_range(FROM..ephemeral_from);
            if !given.contains(&port) && TcpListener::bind(("127.0.0.1", port)).is_ok() {
                given.insert(port);
                return port;
            }
        }
    }
    // No room below the ephemeral range: any free port.
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("binding 127.0.0.1:0 to find a free port")
}

/// The toolgate wasm filter, built by `make build` for wasm32-wasip1. `TOOLGATE_TEST_FILTER_WASM`
/// names another build instead (to show a test failing on an older filter).
pub fn filter_wasm() -> PathBuf {
    let path = std::env::var_os("TOOLGATE_TEST_FILTER_WASM")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            workspace_root().join("target/wasm32-wasip1/release/toolgate_filter.wasm")
        });
    assert!(
        path.exists(),
        "{} is missing: run `make build` first",
        path.display()
    );
    path
}
