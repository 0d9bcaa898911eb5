//! The end-to-end test harness: real etcd, Envoy, toolgate and MCP server processes on free
//! loopback ports, each in its own process group, stopped on drop (also when a test panics),
//! with per-test log files that are printed when the test fails.

pub mod browser;
pub mod envoy;
pub mod etcd;
pub mod faultproxy;
pub mod h2client;
pub mod issuer;
pub mod mcp;
pub mod node;
pub mod paths;
pub mod process;
pub mod rmcp_client;
pub mod schema;
pub mod sdk;
pub mod servers;
pub mod stack;
pub mod testenv;
pub mod wait;
pub mod xds;

pub use browser::Browser;
pub use envoy::{Envoy, EnvoyHost};
pub use etcd::{Etcd, EtcdCluster};
pub use faultproxy::FaultProxy;
pub use issuer::Issuer;
pub use mcp::{McpSession, Reply};
pub use node::{NodeClient, NodeRun, Sdk};
pub use paths::{
    conformance_cli, everything_server, filesystem_server, filter_wasm, free_port,
    loopback_preload, memory_server, project_bin, python_bin, tool_bin,
};
pub use process::{children_of, cpu_ticks, rss_kib, Proc};
pub use servers::{McpServer, Member, Registrant, ServerCommand};
pub use stack::{Options, Stack};
pub use testenv::TestEnv;
pub use wait::{wait_for, wait_until};
pub use xds::{parse_metric, Xds};
