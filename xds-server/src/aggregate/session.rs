//! Gateway sessions for the legacy revisions (2025-03-26 … 2025-11-25).
//!
//! Where the state lives: in the session id itself. `tgv1.` + base64url(24-byte nonce |
//! XChaCha20-Poly1305 ciphertext) of the client's `initialize` parameters, the virtual server,
//! the issue time and a random nonce, sealed under the registry's session key (the key the
//! filters seal `Mcp-Session-Id` with: the same on every gateway of a fleet, kept across
//! restarts in `--state-dir` or `--session-key-file`). Any toolgate-xds of the fleet, and this
//! one after a restart, opens it and knows the session. The associated data is `tgv1` (the
//! filters seal their `tgs1.` ids with `tgs1.<service>`), so one kind of id never opens as the
//! other under the shared key. Nonces come from the operating system's generator; when it
//! fails, no id is issued.
//!
//! Besides, each process keeps in memory, per session it has seen, the time of its last use
//! (idle expiry) and the sessions ended here (DELETE or expiry), so that an ended id is
//! answered 404. What a restart costs: nothing for live sessions (they open again and are
//! adopted); the idle clocks start over, and an id ended before the restart, or ended on
//! another gateway, is accepted again until [`MAX_LIFETIME`] after it was issued. With no key
//! shared across restarts (no state dir, no key file), every client re-initializes once, as the
//! MCP specification allows after a 404.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use base64::Engine;
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use rand::rngs::OsRng;
use rand::TryRngCore;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Prefix of a gateway session id (and of its format).
pub const PREFIX: &str = "tgv1.";
/// The associated data every `tgv1.` id is sealed and opened with: the domain that keeps it
/// apart from the filters' `tgs1.` ids under the same key.
const ASSOCIATED_DATA: &[u8] = b"tgv1";
const NONCE_BYTES: usize = 24;
/// A session unused this long is over: the next request with it gets 404.
pub const IDLE_EXPIRY: Duration = Duration::from_secs(30 * 60);
/// No session outlives this, used or not: it bounds how long an ended id must be remembered.
pub const MAX_LIFETIME: Duration = Duration::from_secs(24 * 3600);
/// The client's `capabilities` and `clientInfo` together, as JSON: they travel in every id.
pub const MAX_CLIENT_PARAMS_BYTES: usize = 4096;
/// Ids longer than this are not opened (a sealed 4 KiB of parameters stays well below).
const MAX_ID_BYTES: usize = 8192;
/// Sessions remembered in memory; beyond, the least recently used are forgotten (harmless:
/// a forgotten live session opens again and is adopted).
const MAX_REMEMBERED: usize = 100_000;

/// What a session id carries.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionClaims {
    /// The virtual server the session belongs to.
    #[serde(rename = "vs")]
    pub virtual_server: String,
    #[serde(rename = "pv")]
    pub protocol_version: String,
    #[serde(rename = "ci", default)]
    pub client_info: Value,
    #[serde(rename = "cc", default)]
    pub capabilities: Value,
    /// Issued at, milliseconds since the Unix epoch.
    #[serde(rename = "iat")]
    pub issued_ms: u64,
    /// Makes two sessions of identical parameters distinct ids and distinct table entries.
    #[serde(rename = "n")]
    pub nonce: String,
}

/// Seals and opens session ids.
pub struct SessionCipher {
    cipher: XChaCha20Poly1305,
}

impl SessionCipher {
    /// A cipher for the key (32 bytes, standard base64); `None` if it is not one.
    pub fn new(key_b64: &str) -> Option<SessionCipher> {
        let key = STANDARD.decode(key_b64.trim()).ok()?;
        if key.len() != 32 {
            return None;
        }
        Some(SessionCipher {
            cipher: XChaCha20Poly1305::new_from_slice(&key).ok()?,
        })
    }

    /// `None` when the claims do not serialize or the operating system gives no random
    /// bytes for the nonce (never a fixed one).
    pub fn seal(&self, claims: &SessionClaims) -> Option<String> {
        let plain = serde_json::to_vec(claims).ok()?;
        let mut nonce = [0u8; NONCE_BYTES];
        OsRng.try_fill_bytes(&mut nonce).ok()?;
        let sealed = self
            .cipher
            .encrypt(
                XNonce::from_slice(&nonce),
                Payload {
                    msg: plain.as_slice(),
                    aad: ASSOCIATED_DATA,
                },
            )
            .ok()?;
        let mut raw = Vec::with_capacity(NONCE_BYTES + sealed.len());
        raw.extend_from_slice(&nonce);
        raw.extend_from_slice(&sealed);
        Some(format!("{PREFIX}{}", URL_SAFE_NO_PAD.encode(raw)))
    }

    /// The claims of an id this key sealed; `None` for anything else.
    pub fn open(&self, id: &str) -> Option<SessionClaims> {
        if id.len() > MAX_ID_BYTES {
            return None;
        }
        let raw = URL_SAFE_NO_PAD.decode(id.strip_prefix(PREFIX)?).ok()?;
        if raw.len() < NONCE_BYTES {
            return None;
        }
        let (nonce, sealed) = raw.split_at(NONCE_BYTES);
        let plain = self
            .cipher
            .decrypt(
                XNonce::from_slice(nonce),
                Payload {
                    msg: sealed,
                    aad: ASSOCIATED_DATA,
                },
            )
            .ok()?;
        serde_json::from_slice(&plain).ok()
    }
}

/// A fresh random nonce for [`SessionClaims::nonce`] (it makes ids unique; the sealing nonce
/// is [`SessionCipher::seal`]'s own).
pub fn fresh_nonce() -> String {
    use rand::RngCore;
    let mut n = [0u8; 12];
    rand::rng().fill_bytes(&mut n);
    URL_SAFE_NO_PAD.encode(n)
}

/// Why a session id is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Not sealed by our key, tampered with, or garbage.
    Unknown,
    /// A session of another virtual server.
    OtherServer,
    /// Idle too long, past its lifetime, or ended (DELETE).
    Ended,
}

#[derive(Default)]
struct Table {
    /// id → last use.
    live: HashMap<String, Instant>,
    /// id → when it may be forgotten (its issue time plus [`MAX_LIFETIME`]).
    ended: HashMap<String, Instant>,
}

/// The sessions this process has seen: see the module comment.
pub struct Sessions {
    cipher: Option<SessionCipher>,
    table: Mutex<Table>,
    idle: Duration,
    /// Bumped whenever sessions end, so that their streams close.
    endings: tokio::sync::watch::Sender<u64>,
}

impl Sessions {
    /// With no usable key, sessions are sealed under a key made for this process (a restart
    /// costs every client one re-initialize).
    pub fn new(key_b64: &str) -> Sessions {
        let cipher = SessionCipher::new(key_b64).or_else(|| {
            let mut key = [0u8; 32];
            OsRng.try_fill_bytes(&mut key).ok()?;
            SessionCipher::new(&STANDARD.encode(key))
        });
        Sessions {
            cipher,
            table: Mutex::new(Table::default()),
            idle: IDLE_EXPIRY,
            endings: tokio::sync::watch::Sender::new(0),
        }
    }

    #[cfg(test)]
    pub fn with_idle(mut self, idle: Duration) -> Sessions {
        self.idle = idle;
        self
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new session id for these claims, recorded as live.
    pub fn issue(&self, claims: &SessionClaims) -> Option<String> {
        let id = self.cipher.as_ref()?.seal(claims)?;
        let mut t = self.table();
        t.live.insert(id.clone(), Instant::now());
        Some(id)
    }

    /// Opens `id` for `virtual_server` and records its use.
    pub fn touch(&self, id: &str, virtual_server: &str) -> Result<SessionClaims, Refused> {
        let claims = self
            .cipher
            .as_ref()
            .and_then(|c| c.open(id))
            .ok_or(Refused::Unknown)?;
        if claims.virtual_server != virtual_server {
            return Err(Refused::OtherServer);
        }
        let age = Duration::from_millis(crate::fleet::now_ms().saturating_sub(claims.issued_ms));
        let now = Instant::now();
        let mut t = self.table();
        if t.ended.contains_key(id) {
            return Err(Refused::Ended);
        }
        let idle_too_long = t
            .live
            .get(id)
            .is_some_and(|last| now.duration_since(*last) >= self.idle);
        if idle_too_long || age >= MAX_LIFETIME {
            t.live.remove(id);
            let forget_at = now + MAX_LIFETIME.saturating_sub(age);
            t.ended.insert(id.to_string(), forget_at);
            drop(t);
            self.ended_some();
            return Err(Refused::Ended);
        }
        // Unknown here but sealed by our key: issued by another gateway or before a restart.
        t.live.insert(id.to_string(), now);
        Ok(claims)
    }

    /// Opens `id` whatever its virtual server, and records its use: a filter asking for the
    /// session held for it with a server is its client calling a tool.
    pub fn touch_any(&self, id: &str) -> Result<SessionClaims, Refused> {
        let claims = self
            .cipher
            .as_ref()
            .and_then(|c| c.open(id))
            .ok_or(Refused::Unknown)?;
        self.touch(id, &claims.virtual_server)
    }

    /// Ends a session (DELETE). Returns its claims when it was one of `virtual_server`'s live
    /// sessions.
    pub fn end(&self, id: &str, virtual_server: &str) -> Result<SessionClaims, Refused> {
        let claims = self.touch(id, virtual_server)?;
        let age = Duration::from_millis(crate::fleet::now_ms().saturating_sub(claims.issued_ms));
        let mut t = self.table();
        t.live.remove(id);
        t.ended.insert(
            id.to_string(),
            Instant::now() + MAX_LIFETIME.saturating_sub(age),
        );
        drop(t);
        self.ended_some();
        Ok(claims)
    }

    fn ended_some(&self) {
        self.endings.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Changes whenever sessions end.
    pub fn endings(&self) -> tokio::sync::watch::Receiver<u64> {
        self.endings.subscribe()
    }

    /// Whether `id` has ended here (DELETE, idle, lifetime).
    pub fn has_ended(&self, id: &str) -> bool {
        self.table().ended.contains_key(id)
    }

    /// Forgets idle sessions and ended ids past their lifetime; returns the sessions ended by
    /// idleness (for the upstream sessions a later change opens per gateway session).
    pub fn sweep(&self) -> Vec<String> {
        let now = Instant::now();
        let mut t = self.table();
        let idle = self.idle;
        let expired: Vec<String> = t
            .live
            .iter()
            .filter(|(_, last)| now.duration_since(**last) >= idle)
            .map(|(id, _)| id.clone())
            .collect();
        for id in &expired {
            t.live.remove(id);
            // Its lifetime is in the id; a day is the most it can have left.
            t.ended.insert(id.clone(), now + MAX_LIFETIME);
        }
        t.ended.retain(|_, forget_at| *forget_at > now);
        if t.live.len() > MAX_REMEMBERED {
            let mut by_use: Vec<(Instant, String)> =
                t.live.iter().map(|(id, at)| (*at, id.clone())).collect();
            by_use.sort();
            let excess = t.live.len() - MAX_REMEMBERED;
            for (_, id) in by_use.into_iter().take(excess) {
                t.live.remove(&id);
            }
        }
        if !expired.is_empty() {
            self.endings.send_modify(|n| *n = n.wrapping_add(1));
        }
        if t.ended.len() > MAX_REMEMBERED {
            let mut by_forget: Vec<(Instant, String)> =
                t.ended.iter().map(|(id, at)| (*at, id.clone())).collect();
            by_forget.sort();
            let excess = t.ended.len() - MAX_REMEMBERED;
            for (_, id) in by_forget.into_iter().take(excess) {
                t.ended.remove(&id);
            }
        }
        expired
    }

    /// Live sessions remembered here.
    pub fn live(&self) -> usize {
        self.table().live.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const KEY: &str = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
    const OTHER_KEY: &str = "HwECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";

    fn claims(vs: &str) -> SessionClaims {
        SessionClaims {
            virtual_server: vs.into(),
            protocol_version: "2025-06-18".into(),
            client_info: json!({"name": "agent", "version": "1"}),
            capabilities: json!({"roots": {}}),
            issued_ms: crate::fleet::now_ms(),
            nonce: fresh_nonce(),
        }
    }

    #[test]
    fn an_id_round_trips_and_shows_nothing() {
        let s = Sessions::new(KEY);
        let c = claims("default");
        let id = s.issue(&c).expect("issued");
        assert!(id.starts_with(PREFIX));
        assert!(!id.contains("agent"), "{id}");
        assert!(id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)));
        assert_eq!(s.touch(&id, "default"), Ok(c));
        // Another process with the same key (another gateway, a restart) adopts it.
        let other = Sessions::new(KEY);
        assert!(other.touch(&id, "default").is_ok());
        assert_eq!(other.live(), 1);
    }

    #[test]
    fn tampered_foreign_and_misplaced_ids_are_refused() {
        let s = Sessions::new(KEY);
        let id = s.issue(&claims("default")).expect("issued");
        let mut tampered = id.clone().into_bytes();
        let last = tampered.len() - 3;
        tampered[last] = if tampered[last] == b'A' { b'B' } else { b'A' };
        let tampered = String::from_utf8(tampered).expect("ascii");
        assert_eq!(s.touch(&tampered, "default"), Err(Refused::Unknown));
        assert_eq!(
            Sessions::new(OTHER_KEY).touch(&id, "default"),
            Err(Refused::Unknown)
        );
        assert_eq!(s.touch(&id, "finance"), Err(Refused::OtherServer));
        for junk in ["", "tgv1.", "tgv1.!!!", "abc", &"x".repeat(20_000)] {
            assert_eq!(s.touch(junk, "default"), Err(Refused::Unknown), "{junk}");
        }
    }

    #[test]
    fn an_id_sealed_for_another_domain_never_opens() {
        use chacha20poly1305::aead::Aead;
        let s = Sessions::new(KEY);
        let c = claims("default");
        let plain = serde_json::to_vec(&c).unwrap();
        let key = STANDARD.decode(KEY).unwrap();
        let cipher = XChaCha20Poly1305::new_from_slice(&key).unwrap();
        let nonce = [7u8; NONCE_BYTES];
        let seal = |aad: &[u8]| {
            let sealed = cipher
                .encrypt(XNonce::from_slice(&nonce), Payload { msg: &plain, aad })
                .unwrap();
            let mut raw = nonce.to_vec();
            raw.extend_from_slice(&sealed);
            format!("{PREFIX}{}", URL_SAFE_NO_PAD.encode(raw))
        };
        // The same claims under the same key, sealed as a filter's `tgs1.` id (bound to its
        // service) or with no associated data at all, relabelled `tgv1.`.
        for aad in [&b"tgs1.orders"[..], b""] {
            assert_eq!(s.touch(&seal(aad), "default"), Err(Refused::Unknown));
        }
        // Sealed with this domain's associated data, it opens (the forgeries' only difference).
        assert_eq!(s.touch(&seal(ASSOCIATED_DATA), "default"), Ok(c));
        // Every id gets a nonce of its own.
        let a = s.issue(&claims("default")).unwrap();
        let b = s.issue(&claims("default")).unwrap();
        let nonce_of =
            |id: &str| URL_SAFE_NO_PAD.decode(&id[PREFIX.len()..]).unwrap()[..NONCE_BYTES].to_vec();
        assert_ne!(nonce_of(&a), nonce_of(&b));
    }

    #[test]
    fn idle_sessions_expire_and_ended_ones_stay_ended() {
        let s = Sessions::new(KEY).with_idle(Duration::from_millis(30));
        let id = s.issue(&claims("default")).expect("issued");
        assert!(s.touch(&id, "default").is_ok());
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(s.touch(&id, "default"), Err(Refused::Ended));
        assert_eq!(s.touch(&id, "default"), Err(Refused::Ended), "stays ended");

        let id2 = s.issue(&claims("default")).expect("issued");
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(s.sweep(), vec![id2.clone()]);
        assert_eq!(s.live(), 0);
        assert_eq!(s.touch(&id2, "default"), Err(Refused::Ended));

        let id3 = s.issue(&claims("default")).expect("issued");
        let endings = s.endings();
        assert!(!s.has_ended(&id3));
        assert!(s.end(&id3, "default").is_ok());
        assert!(endings.has_changed().unwrap_or(false), "streams are told");
        assert!(s.has_ended(&id3));
        assert_eq!(s.touch(&id3, "default"), Err(Refused::Ended));
        assert_eq!(s.end(&id3, "default"), Err(Refused::Ended));
    }

    #[test]
    fn a_session_past_its_lifetime_is_over() {
        let s = Sessions::new(KEY);
        let mut c = claims("default");
        c.issued_ms = crate::fleet::now_ms() - MAX_LIFETIME.as_millis() as u64 - 1;
        let id = s.issue(&c).expect("issued");
        assert_eq!(s.touch(&id, "default"), Err(Refused::Ended));
    }
}
