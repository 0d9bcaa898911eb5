//! The end-to-end test harness: real etcd, Envoy, toolgate and MCP server processes on free
//! loopback ports, each in its own process group, stopped on drop (also when a test panics),
//! with per-test log files that are printed when the test fails.

pub mod etcd;
pub mod faultproxy;
pub mod paths;
pub mod process;
pub mod servers;
pub mod testenv;
pub mod wait;

pub use etcd::Etcd;
pub use faultproxy::FaultProxy;
pub use paths::{free_port, project_bin, tool_bin};
pub use process::Proc;
pub use servers::{McpServer, Registrant};
pub use testenv::TestEnv;
pub use wait::{wait_for, wait_until};
