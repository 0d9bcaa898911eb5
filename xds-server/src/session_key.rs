//! The key the filters seal `Mcp-Session-Id` with (see the filter's `session.rs`): without it,
//! every client would read the upstream instance's address out of its session id.
//!
//! Every gateway of a fleet must seal with the same key, or a session that moves to another
//! gateway is not recognised (its client then initializes again: nothing breaks, it costs a
//! handshake). So the key comes from `--session-key-file` when given (the same secret on every
//! gateway); else it is kept in `--state-dir` (created once, so a restart keeps sessions); else
//! it lives as long as the process.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use rand::rngs::OsRng;
use rand::TryRngCore;

/// The name of the key file in the state dir.
pub const STATE_FILE: &str = "session.key";
const KEY_BYTES: usize = 32;

/// Where the key came from, for the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    File(PathBuf),
    StateDir(PathBuf),
    /// Made at start and kept nowhere.
    Process,
}

/// The sealing key as standard base64, and where it came from.
pub fn load(key_file: Option<&Path>, state_dir: Option<&Path>) -> anyhow::Result<(String, Source)> {
    if let Some(path) = key_file {
        let key = read(path)?;
        return Ok((key, Source::File(path.to_path_buf())));
    }
    let Some(dir) = state_dir else {
        return Ok((STANDARD.encode(fresh()?), Source::Process));
    };
    let path = dir.join(STATE_FILE);
    if path.exists() {
        return Ok((read(&path)?, Source::StateDir(path)));
    }
    std::fs::create_dir_all(dir)
        .with_context(|| format!("creating the state dir {}", dir.display()))?;
    let key = STANDARD.encode(fresh()?);
    write_private(&path, &key)?;
    Ok((key, Source::StateDir(path)))
}

/// A new key from the operating system's generator.
fn fresh() -> anyhow::Result<[u8; KEY_BYTES]> {
    let mut key = [0u8; KEY_BYTES];
    OsRng
        .try_fill_bytes(&mut key)
        .context("the operating system's random generator gave no key")?;
    Ok(key)
}

/// Reads a key file: 32 bytes, as standard base64 (`head -c32 /dev/urandom | base64`).
fn read(path: &Path) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the session key {}", path.display()))?;
    let text = text.trim();
    match STANDARD.decode(text) {
        Ok(bytes) if bytes.len() == KEY_BYTES => Ok(text.to_string()),
        Ok(bytes) => bail!(
            "the session key {} holds {} bytes; it must be {KEY_BYTES} bytes in base64 \
             (head -c32 /dev/urandom | base64)",
            path.display(),
            bytes.len()
        ),
        Err(e) => bail!(
            "the session key {} is not base64 ({e}); make one with: head -c32 /dev/urandom | base64",
            path.display()
        ),
    }
}

/// Writes a new key readable by its owner only.
fn write_private(path: &Path, key: &str) -> anyhow::Result<()> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options
        .open(path)
        .with_context(|| format!("creating the session key {}", path.display()))?;
    writeln!(file, "{key}").with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_dir_keeps_the_key_across_restarts() {
        let dir = std::env::temp_dir().join(format!("toolgate-session-key-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (first, source) = load(None, Some(&dir)).expect("created");
        assert_eq!(source, Source::StateDir(dir.join(STATE_FILE)));
        let (second, _) = load(None, Some(&dir)).expect("read back");
        assert_eq!(first, second);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(dir.join(STATE_FILE))
                .expect("file")
                .permissions()
                .mode();
            assert_eq!(mode & 0o077, 0, "readable by its owner only");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_bad_key_file_is_refused_with_its_name() {
        let path = std::env::temp_dir().join(format!("toolgate-bad-key-{}", std::process::id()));
        std::fs::write(&path, "AAEC").expect("write");
        let err = load(Some(&path), None).expect_err("3 bytes").to_string();
        assert!(
            err.contains(&path.display().to_string()) && err.contains("3 bytes"),
            "{err}"
        );
        std::fs::write(&path, "not base64!").expect("write");
        assert!(load(Some(&path), None).is_err());
        let _ = std::fs::remove_file(&path);
        let (a, source) = load(None, None).expect("ephemeral");
        assert_eq!(source, Source::Process);
        assert_eq!(STANDARD.decode(a).expect("base64").len(), KEY_BYTES);
    }
}
