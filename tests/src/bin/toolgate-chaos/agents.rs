//! Steady agent load: MCP clients calling tools through the gateway in a loop, each call
//! recorded with when it was sent and what came back. Agents of a service's route call its
//! tools; agents of the aggregate endpoint (`/mcp`) call the lab's tools and the desk's (a
//! server with sessions, which the gateway holds for them), and every tenth round a new
//! client initializes and lists, as agents arriving during the faults do.

use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::json;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use toolgate_tests::{McpSession, Reply};

const TOOLS: [&str; 3] = ["read_order", "write_order", "echo"];
/// The same through `/mcp`, and the desk's echo (a held session).
const AGGREGATE_TOOLS: [&str; 4] = [
    "lab__read_order",
    "lab__write_order",
    "lab__echo",
    "desk__echo",
];

/// What an agent saw.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// The tool's own answer, from this instance.
    Answered { instance: String },
    /// The result of a request that is not a call (`initialize`, `tools/list`).
    Listed,
    /// A JSON-RPC response with the request's id that says the call failed (the gateway's
    /// tool-error reply, or a JSON-RPC error): the failure an agent can act on.
    Semantic { kind: String },
    /// Anything else: an HTTP error without a JSON-RPC response for the call.
    Bare { status: u16, body: String },
    /// No HTTP response at all.
    Transport { error: String },
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Answered { instance } => write!(f, "answered by {instance}"),
            Outcome::Listed => write!(f, "a result"),
            Outcome::Semantic { kind } => write!(f, "MCP failure reply ({kind})"),
            Outcome::Bare { status, body } => {
                write!(f, "HTTP {status} without a JSON-RPC response: {body}")
            }
            Outcome::Transport { error } => write!(f, "transport error: {error}"),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Call {
    /// Milliseconds since the run's start.
    pub sent_ms: f64,
    pub took_ms: f64,
    pub agent: usize,
    /// The tool called, or the method of a request that is not a call.
    pub tool: &'static str,
    /// Sent to the aggregate endpoint (`/mcp`), not a service's route.
    pub aggregate: bool,
    pub outcome: Outcome,
}

pub struct Load {
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<Vec<Call>>>,
}

impl Load {
    /// `agents` clients of a service's route at `url` and `aggregate_agents` of the aggregate
    /// endpoint at `aggregate_url`, each calling a tool, waiting `pause`, and calling again.
    pub async fn start(
        url: &str,
        agents: usize,
        aggregate_url: &str,
        aggregate_agents: usize,
        pause: Duration,
        t0: Instant,
    ) -> Load {
        let (stop, stopped) = watch::channel(false);
        let mut tasks = Vec::new();
        for agent in 0..agents + aggregate_agents {
            let aggregate = agent >= agents;
            let url = if aggregate { aggregate_url } else { url };
            let mut session = McpSession::unconnected(url);
            // Agents start on a healthy gateway; initialize is part of every MCP session.
            let init = session.initialize().await;
            assert_eq!(
                init.status,
                StatusCode::OK,
                "agent {agent} initialize: {}",
                init.body
            );
            let stopped = stopped.clone();
            tasks.push(tokio::spawn(run(
                agent, aggregate, session, pause, t0, stopped,
            )));
        }
        Load { stop, tasks }
    }

    pub async fn finish(self) -> Vec<Call> {
        let _ = self.stop.send(true);
        let mut calls = Vec::new();
        for t in self.tasks {
            calls.extend(t.await.unwrap_or_default());
        }
        calls.sort_by(|a, b| a.sent_ms.total_cmp(&b.sent_ms));
        calls
    }
}

async fn run(
    agent: usize,
    aggregate: bool,
    mut session: McpSession,
    pause: Duration,
    t0: Instant,
    stopped: watch::Receiver<bool>,
) -> Vec<Call> {
    let mut calls = Vec::new();
    let mut n: u64 = 0;
    let record = |calls: &mut Vec<Call>, sent: Instant, tool, outcome| {
        calls.push(Call {
            sent_ms: ms(sent.duration_since(t0)),
            took_ms: ms(sent.elapsed()),
            agent,
            tool,
            aggregate,
            outcome,
        })
    };
    while !*stopped.borrow() {
        n += 1;
        if aggregate && n.is_multiple_of(10) {
            // A new agent arrives: it initializes and lists.
            let mut fresh = McpSession::unconnected(&session.url);
            let sent = Instant::now();
            let init = fresh.initialize().await;
            record(&mut calls, sent, "initialize", classify_request(&init));
            if init.status == StatusCode::OK {
                let sent = Instant::now();
                let list = fresh.list_tools().await;
                record(&mut calls, sent, "tools/list", classify_request(&list));
            }
        }
        let tool = if aggregate {
            AGGREGATE_TOOLS[(n as usize + agent) % AGGREGATE_TOOLS.len()]
        } else {
            TOOLS[(n as usize + agent) % TOOLS.len()]
        };
        let sent = Instant::now();
        let reply = session
            .call_tool(tool, json!({"agent": agent, "n": n}))
            .await;
        record(&mut calls, sent, tool, classify(&reply));
        tokio::time::sleep(pause).await;
    }
    calls
}

/// A request that is not a call: its result, a JSON-RPC error (semantic), or not MCP.
fn classify_request(reply: &Reply) -> Outcome {
    match &reply.message {
        Some(m) if m.get("result").is_some() => Outcome::Listed,
        Some(m) if m.get("error").is_some() => Outcome::Semantic {
            kind: format!("JSON-RPC error {}", m["error"]["code"]),
        },
        _ => classify(reply),
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn classify(reply: &Reply) -> Outcome {
    // McpSession reports a transport error as status 599 with the error's text.
    if reply.status.as_u16() == 599 && reply.message.is_none() {
        return Outcome::Transport {
            error: reply.body.clone(),
        };
    }
    let Some(message) = &reply.message else {
        return Outcome::Bare {
            status: reply.status.as_u16(),
            body: reply.body.chars().take(300).collect(),
        };
    };
    if let Some(error) = message.get("error") {
        return Outcome::Semantic {
            kind: format!("JSON-RPC error {}", error["code"]),
        };
    }
    let result = &message["result"];
    if result["isError"] == true {
        return Outcome::Semantic {
            kind: reply
                .breaker_state()
                .unwrap_or_else(|| "tool error".to_string()),
        };
    }
    match result["structuredContent"]["instance_id"].as_str() {
        Some(instance) => Outcome::Answered {
            instance: instance.to_string(),
        },
        None => Outcome::Bare {
            status: reply.status.as_u16(),
            body: reply.body.chars().take(300).collect(),
        },
    }
}
