//! The last good registry on disk (`--state-dir`), so that a toolgate-xds restarted while etcd
//! is down still serves the endpoints it knew instead of an empty table.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

const FILE: &str = "registry.json";

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PersistedRegistry {
    pub revision: i64,
    /// (key, value) exactly as stored in etcd, so loading goes through the same validation.
    pub values: Vec<(String, String)>,
    /// Each instance key's etcd create revision: its service's age, which decides who keeps
    /// a contested tool name on a virtual server. Absent in snapshots written before.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub created: BTreeMap<String, i64>,
}

pub fn path(dir: &Path) -> PathBuf {
    dir.join(FILE)
}

/// Writes to a temporary file and renames it over the old one: a crash mid-write never
/// leaves a torn file behind.
pub fn save(dir: &Path, state: &PersistedRegistry) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!("{FILE}.tmp"));
    let bytes = serde_json::to_vec(state).map_err(std::io::Error::other)?;
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&bytes)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path(dir))
}

pub fn load(dir: &Path) -> std::io::Result<PersistedRegistry> {
    let bytes = std::fs::read(path(dir))?;
    serde_json::from_slice(&bytes).map_err(|e| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("{}: {e}", path(dir).display()),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_a_rename() {
        let dir = std::env::temp_dir().join(format!("toolgate-persist-{}", std::process::id()));
        let state = PersistedRegistry {
            revision: 42,
            values: vec![("/mcp/services/a/b".into(), "{}".into())],
            created: BTreeMap::from([("/mcp/services/a/b".to_string(), 7)]),
        };
        save(&dir, &state).unwrap();
        assert_eq!(load(&dir).unwrap(), state);
        assert!(!dir.join("registry.json.tmp").exists());
        std::fs::write(path(&dir), b"{torn").unwrap();
        assert!(load(&dir).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
