//! A child process in its own process group, killed with its whole group on drop.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;

pub struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
    exited: Option<ExitStatus>,
}

impl Proc {
    /// Starts `program` with stdout and stderr appended to `log`.
    pub(crate) fn spawn(
        name: &str,
        program: &Path,
        args: &[String],
        envs: &[(String, String)],
        log: PathBuf,
    ) -> Proc {
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap_or_else(|e| panic!("opening log {}: {e}", log.display()));
        let _ = writeln!(file, "=== {name}: {} {}", program.display(), args.join(" "));
        let stderr = file.try_clone().expect("cloning log file handle");
        let child = Command::new(program)
            .args(args)
            .envs(envs.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(file)
            .stderr(stderr)
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {name} ({}): {e}", program.display()));
        Proc {
            name: name.to_string(),
            child,
            log,
            exited: None,
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends `sig` to the process itself (not its group).
    pub fn signal(&self, sig: Signal) {
        let _ = kill(Pid::from_raw(self.pid()), sig);
    }

    /// Sends `sig` to the process and everything it started.
    pub fn signal_group(&self, sig: Signal) {
        let _ = killpg(Pid::from_raw(self.pid()), sig);
    }

    /// The exit status, if it has exited (reaps it).
    pub fn try_exit_status(&mut self) -> Option<ExitStatus> {
        if self.exited.is_none() {
            self.exited = self.child.try_wait().ok().flatten();
        }
        self.exited
    }

    pub fn is_running(&mut self) -> bool {
        self.try_exit_status().is_none()
    }

    /// Waits up to `timeout` for the process to exit.
    pub async fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let started = Instant::now();
        loop {
            if let Some(status) = self.try_exit_status() {
                return Some(status);
            }
            if started.elapsed() > timeout {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// SIGTERM to the group, then SIGKILL if it has not exited within `grace`.
    pub async fn stop(&mut self, grace: Duration) -> Option<ExitStatus> {
        if self.is_running() {
            self.signal_group(Signal::SIGTERM);
        }
        match self.wait_exit(grace).await {
            Some(status) => Some(status),
            None => {
                self.kill();
                None
            }
        }
    }

    /// SIGKILL to the whole group, and reap.
    pub fn kill(&mut self) {
        // A stopped process would not run its SIGKILL handler... it has none, but a stopped
        // group member keeps the group alive for a moment; SIGCONT is harmless.
        self.signal_group(Signal::SIGKILL);
        self.signal_group(Signal::SIGCONT);
        if self.exited.is_none() {
            self.exited = self.child.wait().ok();
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // Kill the group even if the leader exited: its children may still be alive.
        self.signal_group(Signal::SIGKILL);
        if self.exited.is_none() {
            let _ = self.child.wait();
        }
    }
}

/// utime + stime of a process, in clock ticks (100 per second on Linux); 0 if it is gone.
pub fn cpu_ticks(pid: i32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which is in parentheses and may hold spaces).
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let get = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    // utime and stime are fields 14 and 15 of stat; 12 and 13 after the name.
    get(11) + get(12)
}

/// The processes whose parent is `pid` (a registrar's servers).
pub fn children_of(pid: i32) -> Vec<i32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(child) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{child}/stat")) else {
            continue;
        };
        // pid (comm) state ppid ...: comm may hold spaces, so read after its ')'.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<i32>().ok());
        if ppid == Some(pid) {
            out.push(child);
        }
    }
    out
}

/// Resident memory of a process, in KiB; 0 if it is gone.
pub fn rss_kib(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next().and_then(|n| n.parse().ok()))
        .unwrap_or(0)
}
