//! One test's environment: a directory for its logs and data, and the logs printed on failure.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::paths::workspace_root;
use crate::process::Proc;

/// Lines printed from the end of each log when a test fails.
const TAIL_LINES: usize = 200;

pub struct TestEnv {
    name: String,
    dir: PathBuf,
    logs: Arc<Mutex<Vec<PathBuf>>>,
    /// When set, only logs whose process name starts with one of these are printed on failure.
    print_only: Mutex<Option<Vec<String>>>,
}

impl TestEnv {
    /// A fresh directory `tests/logs/<name>/` (emptied if it exists).
    pub fn new(name: &str) -> TestEnv {
        let dir = workspace_root().join("tests/logs").join(name);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("creating {}: {e}", dir.display()));
        TestEnv {
            name: name.to_string(),
            dir,
            logs: Arc::default(),
            print_only: Mutex::new(None),
        }
    }

    /// Limits the logs printed on failure to processes whose names start with one of
    /// `prefixes` (a run of hundreds of processes would bury the ones that matter); the rest
    /// stay in the test's directory.
    pub fn print_only(&self, prefixes: &[&str]) {
        *self.print_only.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(prefixes.iter().map(|p| p.to_string()).collect());
    }

    /// Prints the logs as a failing test does (for a run that reports failure without
    /// panicking).
    pub fn print_failure_logs(&self) {
        self.print_logs();
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A path inside the test's directory (for data dirs, config files).
    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.join(rel)
    }

    /// Starts a process whose output goes to `<dir>/<name>.log`.
    pub fn spawn(&self, name: &str, program: &Path, args: &[String]) -> Proc {
        self.spawn_with_env(name, program, args, &[])
    }

    pub fn spawn_with_env(
        &self,
        name: &str,
        program: &Path,
        args: &[String],
        envs: &[(String, String)],
    ) -> Proc {
        let log = self.dir.join(format!("{name}.log"));
        {
            let mut logs = self.logs.lock().unwrap_or_else(|p| p.into_inner());
            if !logs.contains(&log) {
                logs.push(log.clone());
            }
        }
        Proc::spawn(name, program, args, envs, log)
    }

    fn print_logs(&self) {
        let logs = self.logs.lock().unwrap_or_else(|p| p.into_inner());
        let only = self
            .print_only
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        eprintln!(
            "\n===== test {} failed; logs of its processes (in {}) =====",
            self.name,
            self.dir.display()
        );
        for log in logs.iter() {
            let name = log
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            if let Some(only) = &only {
                if !only.iter().any(|p| name.starts_with(p.as_str())) {
                    continue;
                }
            }
            let text = std::fs::read_to_string(log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let from = lines.len().saturating_sub(TAIL_LINES);
            eprintln!(
                "----- {} (last {} of {} lines) -----",
                log.display(),
                lines.len() - from,
                lines.len()
            );
            for line in &lines[from..] {
                eprintln!("{line}");
            }
        }
        eprintln!("===== end of logs of {} =====", self.name);
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.print_logs();
            return;
        }
        // A passed test keeps its logs, not its data: etcd preallocates 64 MB of WAL per
        // member, and a full run left 16 GB of it behind. The test's processes are gone by
        // now (the environment is made first in every test, so it is dropped last).
        if let Ok(entries) = std::fs::read_dir(&self.dir) {
            for entry in entries.flatten() {
                let path = entry.path();
                if path.is_dir() && path.extension().is_some_and(|e| e == "data") {
                    let _ = std::fs::remove_dir_all(&path);
                }
            }
        }
    }
}
