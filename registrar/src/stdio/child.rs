//! One stdio server process: started with pipes, in its own process group (so that ending it
//! ends what it started, such as the `node` under `npx`), with three tasks: one writes its
//! input from a queue bounded in bytes (a server that stops reading fills its own queue, and
//! only its own), one reads its output line by line within `--max-message-bytes`, one logs its
//! stderr with its pid. Whatever ends it (an exit, a line that is not JSON-RPC, a line too
//! long, the bridge) is reported once, as [`Ended`].

use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio::io::AsyncWriteExt;
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore, TryAcquireError};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::lines::{Line, LineReader};
use super::wire;

/// How long a server whose output ended may take to exit before it is killed.
const EXIT_GRACE: Duration = Duration::from_secs(2);
/// The longest stderr line logged whole.
const MAX_STDERR_LINE: usize = 16 * 1024;
/// Messages read ahead of the bridge: a server writing faster waits on its pipe.
const READ_AHEAD: usize = 1024;
/// Writes of queued messages are joined up to this size.
const WRITE_BATCH: usize = 64 * 1024;

/// Why a server process ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Fault {
    /// Its output ended: it exited (or closed its stdout).
    Exited,
    /// It wrote a line longer than `--max-message-bytes`.
    TooLong { limit: usize },
    /// It wrote a line that is not a JSON-RPC message.
    Garbage { what: String },
    /// It had requests waiting, wrote nothing, and did not answer a ping.
    Hung { after: Duration },
    /// It did not finish the handshake the bridge opens it with.
    Handshake(String),
    /// Reading its output failed.
    ReadFailed(String),
    /// The bridge ended it (its session ended, or the bridge stops).
    Stopped,
}

/// How a server process ended.
#[derive(Debug, Clone)]
pub struct Ended {
    pub pid: u32,
    pub fault: Fault,
    pub status: Option<ExitStatus>,
    pub ran: Duration,
}

impl Ended {
    /// A failure for the restart policy: anything but a clean exit on its own.
    pub fn failed(&self) -> bool {
        match self.fault {
            Fault::Exited => !self.status.is_some_and(|s| s.success()),
            _ => true,
        }
    }

    /// One word for logs and error data.
    pub fn kind(&self) -> &'static str {
        match self.fault {
            Fault::Exited => "exited",
            Fault::TooLong { .. } => "line_too_long",
            Fault::Garbage { .. } => "not_json_rpc",
            Fault::Hung { .. } => "hung",
            Fault::Handshake(_) => "handshake",
            Fault::ReadFailed(_) => "read_failed",
            Fault::Stopped => "stopped",
        }
    }

    /// What happened, in words a model and an operator can act on.
    pub fn describe(&self) -> String {
        let pid = self.pid;
        let status = match self.status {
            Some(s) => s.to_string(),
            None => "status unknown".into(),
        };
        match &self.fault {
            Fault::Exited => format!("the stdio server (pid {pid}) exited ({status})"),
            Fault::TooLong { limit } => format!(
                "the stdio server (pid {pid}) wrote a line longer than {limit} bytes \
                 (--max-message-bytes); it was ended"
            ),
            Fault::Garbage { what } => format!(
                "the stdio server (pid {pid}) wrote something that is not JSON-RPC ({what}); \
                 it was ended"
            ),
            Fault::Hung { after } => format!(
                "the stdio server (pid {pid}) hangs: it wrote nothing for {} with requests \
                 waiting and did not answer a ping; it was ended",
                humantime::format_duration(*after)
            ),
            Fault::Handshake(why) => format!(
                "the stdio server (pid {pid}) did not complete its handshake ({why}); it was ended"
            ),
            Fault::ReadFailed(why) => {
                format!("reading the stdio server's output (pid {pid}) failed: {why}")
            }
            Fault::Stopped => format!("the stdio server (pid {pid}) was stopped"),
        }
    }
}

/// What a server process says, in order.
#[derive(Debug)]
pub enum Event {
    Message(Value),
    Ended(Ended),
}

/// What the bridge wants of a process.
#[derive(Debug, Clone, PartialEq)]
enum Order {
    Run,
    Kill(Fault),
    /// Close its input, then SIGTERM after the grace, then SIGKILL after as long again.
    Stop(Duration),
}

/// Orders a process; cheap to clone.
#[derive(Clone)]
pub struct Control {
    orders: Arc<watch::Sender<Order>>,
}

impl Control {
    /// Ends the process at once for `fault`.
    pub fn kill(&self, fault: Fault) {
        self.orders.send_if_modified(|o| {
            let first = *o == Order::Run || matches!(o, Order::Stop(_));
            if first {
                *o = Order::Kill(fault);
            }
            first
        });
    }

    /// Ends the process gently: its input closes (MCP's way to end a stdio server), then it
    /// gets SIGTERM and, later, SIGKILL.
    pub fn stop(&self, grace: Duration) {
        self.orders.send_if_modified(|o| {
            let first = *o == Order::Run;
            if first {
                *o = Order::Stop(grace);
            }
            first
        });
    }
}

/// Why a message could not be queued for a server.
#[derive(Debug, Clone, PartialEq)]
pub enum SendError {
    /// Its queue holds as many bytes as it may: it is not reading its input.
    Full { queued: usize },
    /// Its input is closed.
    Closed,
}

/// The input queue of one process.
#[derive(Clone)]
pub struct Input {
    tx: mpsc::UnboundedSender<(Vec<u8>, OwnedSemaphorePermit)>,
    budget: Arc<Semaphore>,
    limit: usize,
}

impl Input {
    /// Queues one line (with its newline) without waiting.
    pub fn send(&self, line: Vec<u8>) -> Result<(), SendError> {
        let n =
            u32::try_from(line.len().max(1)).map_err(|_| SendError::Full { queued: self.limit })?;
        let permit = match Arc::clone(&self.budget).try_acquire_many_owned(n) {
            Ok(p) => p,
            Err(TryAcquireError::NoPermits) => {
                return Err(SendError::Full {
                    queued: self.limit.saturating_sub(self.budget.available_permits()),
                })
            }
            Err(TryAcquireError::Closed) => return Err(SendError::Closed),
        };
        self.tx.send((line, permit)).map_err(|_| SendError::Closed)
    }
}

/// A started process and its handles.
pub struct Spawned {
    pub pid: u32,
    pub input: Input,
    pub events: mpsc::Receiver<Event>,
    pub control: Control,
}

impl Spawned {
    /// Nothing came from it yet: neither a message nor its end (a spare that is still fit to
    /// be handed a session).
    pub fn untouched(&self) -> bool {
        self.events.is_empty()
    }
}

/// Starts `command` with pipes. `max_line` bounds each line read from it; the input queue
/// holds at most `queue_bytes`.
pub fn spawn(command: &[String], max_line: usize, queue_bytes: usize) -> std::io::Result<Spawned> {
    let (program, args) = command.split_first().ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, "no server command")
    })?;
    let mut cmd = Command::new(program);
    cmd.args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    // SAFETY: prctl is async-signal-safe; the closure allocates nothing.
    unsafe {
        cmd.pre_exec(|| {
            // If the registrar is SIGKILLed, its servers must not live on unsupervised.
            nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM)
                .map_err(std::io::Error::from)
        });
    }
    let mut child = cmd.spawn()?;
    let missing = |what: &str| std::io::Error::other(format!("the server's {what} is not piped"));
    let pid = child.id().ok_or_else(|| missing("pid"))?;
    let stdin = child.stdin.take().ok_or_else(|| missing("stdin"))?;
    let stdout = child.stdout.take().ok_or_else(|| missing("stdout"))?;
    let stderr = child.stderr.take().ok_or_else(|| missing("stderr"))?;

    let (orders_tx, orders_rx) = watch::channel(Order::Run);
    let (input_tx, input_rx) = mpsc::unbounded_channel();
    let (events_tx, events_rx) = mpsc::channel(READ_AHEAD);
    let limit = queue_bytes.clamp(1, Semaphore::MAX_PERMITS);
    let started = Instant::now();
    tokio::spawn(write_input(stdin, input_rx, orders_rx.clone()));
    tokio::spawn(log_stderr(stderr, pid));
    tokio::spawn(supervise(
        child, stdout, events_tx, orders_rx, max_line, pid, started,
    ));
    info!(pid, command = ?command, "stdio server started");
    Ok(Spawned {
        pid,
        input: Input {
            tx: input_tx,
            budget: Arc::new(Semaphore::new(limit)),
            limit,
        },
        events: events_rx,
        control: Control {
            orders: Arc::new(orders_tx),
        },
    })
}

async fn write_input(
    mut stdin: ChildStdin,
    mut queue: mpsc::UnboundedReceiver<(Vec<u8>, OwnedSemaphorePermit)>,
    mut orders: watch::Receiver<Order>,
) {
    loop {
        let first = tokio::select! {
            item = queue.recv() => match item {
                Some(item) => item,
                None => break,
            },
            changed = orders.changed() => {
                if changed.is_err() || *orders.borrow() != Order::Run {
                    break;
                }
                continue;
            }
        };
        // Messages queued meanwhile go in the same write.
        let (mut batch, permit) = first;
        let mut permits = vec![permit];
        while batch.len() < WRITE_BATCH {
            match queue.try_recv() {
                Ok((line, p)) => {
                    batch.extend_from_slice(&line);
                    permits.push(p);
                }
                Err(_) => break,
            }
        }
        if let Err(e) = stdin.write_all(&batch).await {
            debug!(error = %e, "the stdio server's input closed");
            break;
        }
        drop(permits);
    }
    // Dropping stdin closes the server's input.
}

async fn log_stderr(stderr: tokio::process::ChildStderr, pid: u32) {
    let mut lines = LineReader::new(stderr, MAX_STDERR_LINE);
    loop {
        match lines.next().await {
            Ok(Some(Line::Text(t))) => {
                info!(target: "toolgate_registrar::stdio::stderr", pid, "{}", String::from_utf8_lossy(&t));
            }
            Ok(Some(Line::TooLong)) => {
                info!(target: "toolgate_registrar::stdio::stderr", pid, "(a line longer than {MAX_STDERR_LINE} bytes, not logged)");
            }
            Ok(None) | Err(_) => break,
        }
    }
}

async fn supervise(
    mut child: Child,
    stdout: ChildStdout,
    events: mpsc::Sender<Event>,
    mut orders: watch::Receiver<Order>,
    max_line: usize,
    pid: u32,
    started: Instant,
) {
    let mut reader = LineReader::new(stdout, max_line);
    // While stopping: when to escalate, how long each step is, and whether SIGTERM went.
    let mut stopping: Option<(Instant, Duration, bool)> = None;
    let fault = loop {
        let escalate_at = stopping.map(|(at, _, _)| at);
        tokio::select! {
            changed = orders.changed() => {
                if changed.is_err() {
                    break Fault::Stopped;
                }
                let order = orders.borrow_and_update().clone();
                match order {
                    Order::Kill(f) => break f,
                    Order::Stop(grace) if stopping.is_none() => {
                        stopping = Some((Instant::now() + grace, grace, false));
                    }
                    _ => {}
                }
            }
            () = async {
                match escalate_at {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            } => {
                if let Some((_, grace, termed)) = stopping {
                    if termed {
                        break Fault::Stopped;
                    }
                    signal_group(pid, nix::sys::signal::Signal::SIGTERM);
                    stopping = Some((Instant::now() + grace, grace, true));
                }
            }
            line = reader.next() => match line {
                Ok(None) => break if stopping.is_some() { Fault::Stopped } else { Fault::Exited },
                Ok(Some(Line::TooLong)) => break Fault::TooLong { limit: max_line },
                Ok(Some(Line::Text(text))) => {
                    if text.iter().all(u8::is_ascii_whitespace) {
                        continue;
                    }
                    match serde_json::from_slice::<Value>(&text) {
                        Ok(v) => match wire::kind(&v) {
                            wire::Kind::Invalid(why) => break Fault::Garbage {
                                what: format!("{why}: {}", wire::snippet(&text)),
                            },
                            _ => {
                                if events.send(Event::Message(v)).await.is_err() {
                                    break Fault::Stopped;
                                }
                            }
                        },
                        Err(_) => break Fault::Garbage {
                            what: format!("{:?}", wire::snippet(&text)),
                        },
                    }
                }
                Err(e) => break Fault::ReadFailed(e.to_string()),
            },
        }
    };
    let status = match fault {
        Fault::Exited | Fault::Stopped => {
            match tokio::time::timeout(EXIT_GRACE, child.wait()).await {
                Ok(Ok(status)) => Some(status),
                _ => {
                    signal_group(pid, nix::sys::signal::Signal::SIGKILL);
                    child.wait().await.ok()
                }
            }
        }
        _ => {
            signal_group(pid, nix::sys::signal::Signal::SIGKILL);
            child.wait().await.ok()
        }
    };
    // What it started in its group (npx's node) goes with it.
    signal_group(pid, nix::sys::signal::Signal::SIGKILL);
    let ended = Ended {
        pid,
        fault,
        status,
        ran: started.elapsed(),
    };
    if ended.fault == Fault::Stopped {
        info!(pid, status = ?ended.status, "stdio server stopped");
    } else {
        warn!(pid, fault = ended.kind(), "{}", ended.describe());
    }
    let _ = events.send(Event::Ended(ended)).await;
}

fn signal_group(pid: u32, signal: nix::sys::signal::Signal) {
    if let Ok(pid) = i32::try_from(pid) {
        let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pid), signal);
    }
}
