//! The machine the figures were measured on, and the Linux knobs the data-plane suite uses to
//! keep its processes apart: CPU affinity (`taskset`) and per-process CPU time (`/proc`).

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context};
use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    /// Logical CPUs (`processor` entries in /proc/cpuinfo).
    pub cores: usize,
    pub cpu_model: String,
    pub kernel: String,
    pub envoy: String,
    pub wrk: String,
}

impl Machine {
    pub fn detect(envoy: &Path) -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cores = cpuinfo
            .lines()
            .filter(|l| l.starts_with("processor"))
            .count()
            .max(1);
        let cpu_model = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name")?.split_once(':'))
            .map(|(_, m)| m.trim().to_string())
            .unwrap_or_else(|| "unknown".into());
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "unknown".into());
        let first_line = |program: &Path, arg: &str| -> String {
            Command::new(program)
                .arg(arg)
                .output()
                .ok()
                .and_then(|o| {
                    let mut text = String::from_utf8_lossy(&o.stdout).into_owned();
                    text.push_str(&String::from_utf8_lossy(&o.stderr));
                    text.lines()
                        .map(str::trim)
                        .find(|l| !l.is_empty())
                        .map(str::to_string)
                })
                .unwrap_or_else(|| "unknown".into())
        };
        Machine {
            cores,
            cpu_model,
            kernel,
            envoy: first_line(envoy, "--version"),
            wrk: first_line(Path::new("wrk"), "-v"),
        }
    }

    pub fn describe(&self) -> String {
        format!(
            "{} logical cores, {}, Linux {}",
            self.cores, self.cpu_model, self.kernel
        )
    }
}

/// Sets the CPU affinity of every thread of process `pid` (threads it starts later inherit it).
pub fn pin(pid: i32, cpus: &str) -> anyhow::Result<()> {
    let out = Command::new("taskset")
        .args(["-a", "-p", "-c", cpus, &pid.to_string()])
        .output()
        .context("running taskset (util-linux)")?;
    if !out.status.success() {
        bail!(
            "taskset -a -p -c {cpus} {pid} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// The distinct `Cpus_allowed_list` values of the threads of `pid`.
pub fn affinity(pid: i32) -> Vec<String> {
    let mut lists: Vec<String> = tasks(pid)
        .filter_map(|task| {
            let status = std::fs::read_to_string(task.join("status")).ok()?;
            status
                .lines()
                .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                .map(|s| s.trim().to_string())
        })
        .collect();
    lists.sort();
    lists.dedup();
    lists
}

/// CPU time of every thread of `pid` so far, in nanoseconds (`/proc/PID/task/*/schedstat`).
pub fn cpu_ns(pid: i32) -> u64 {
    tasks(pid)
        .filter_map(|task| {
            std::fs::read_to_string(task.join("schedstat"))
                .ok()?
                .split_whitespace()
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

fn tasks(pid: i32) -> impl Iterator<Item = std::path::PathBuf> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok().map(|e| e.path()))
}

/// One reading of the per-core counters of /proc/stat, in jiffies (USER_HZ, 100 per second).
#[derive(Debug, Clone, Default)]
pub struct CoreTimes {
    /// Per core: user + nice + system + irq + softirq.
    pub busy: Vec<u64>,
    pub softirq: Vec<u64>,
    pub steal: Vec<u64>,
    /// Per core: every field up to steal (guest time is inside user).
    pub total: Vec<u64>,
}

pub fn core_times() -> CoreTimes {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let mut t = CoreTimes::default();
    for l in stat
        .lines()
        .filter(|l| l.starts_with("cpu") && !l.starts_with("cpu "))
    {
        let v: Vec<u64> = l
            .split_whitespace()
            .skip(1)
            .filter_map(|x| x.parse().ok())
            .collect();
        let f = |i: usize| v.get(i).copied().unwrap_or(0);
        // user nice system idle iowait irq softirq steal
        t.busy.push(f(0) + f(1) + f(2) + f(5) + f(6));
        t.softirq.push(f(6));
        t.steal.push(f(7));
        t.total.push((0..8).map(f).sum());
    }
    t
}

/// Nanoseconds per jiffy of /proc/stat and /proc/PID/stat (USER_HZ is 100 on Linux).
pub const JIFFY_NS: u64 = 10_000_000;

impl CoreTimes {
    /// Percent busy per core since `before`.
    pub fn busy_percent(&self, before: &CoreTimes) -> Vec<f64> {
        self.busy
            .iter()
            .zip(&before.busy)
            .zip(self.total.iter().zip(&before.total))
            .map(|((a, b), (ta, tb))| {
                let total = ta.saturating_sub(*tb);
                if total == 0 {
                    0.0
                } else {
                    100.0 * a.saturating_sub(*b) as f64 / total as f64
                }
            })
            .collect()
    }

    /// Busy time of all cores since `before`, without softirq (which no task is charged for).
    pub fn task_busy_ns(&self, before: &CoreTimes) -> u64 {
        let sum = |v: &[u64]| v.iter().sum::<u64>();
        (sum(&self.busy).saturating_sub(sum(&before.busy)))
            .saturating_sub(sum(&self.softirq).saturating_sub(sum(&before.softirq)))
            * JIFFY_NS
    }

    /// Stolen time (the hypervisor ran someone else) of all cores since `before`.
    pub fn steal_ns(&self, before: &CoreTimes) -> u64 {
        let sum = |v: &[u64]| v.iter().sum::<u64>();
        sum(&self.steal).saturating_sub(sum(&before.steal)) * JIFFY_NS
    }
}

/// CPU time of this process, its live children (all threads) and its reaped children
/// (`cutime + cstime`), in nanoseconds: everything the bench started.
pub fn own_tree_cpu_ns() -> u64 {
    let me = std::process::id() as i32;
    let reaped = std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            // Fields after the command name, which is in parentheses and may hold spaces.
            let rest = s.rsplit_once(')')?.1;
            let f: Vec<&str> = rest.split_whitespace().collect();
            // rest[0] is field 3 (state); cutime and cstime are fields 16 and 17.
            Some(f.get(13)?.parse::<u64>().ok()? + f.get(14)?.parse::<u64>().ok()?)
        })
        .unwrap_or(0)
        * JIFFY_NS;
    let children: u64 = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| parent_of(*pid) == Some(me))
        .map(cpu_ns)
        .sum();
    cpu_ns(me) + children + reaped
}

fn parent_of(pid: i32) -> Option<i32> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    s.rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}
