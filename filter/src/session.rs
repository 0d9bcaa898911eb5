//! Sealing `Mcp-Session-Id`.
//!
//! Envoy's session affinity (the stateful-session filter's envelope) writes the upstream
//! instance's address into the session id the agent gets back (`base64(ip:port);<server's id>`):
//! every client would learn the addresses behind the gateway. The filter sits before that
//! filter, so it sees the envelope on the way out and the agent's value on the way in: it
//! encrypts the whole value on the way out (`tgs1.` and base64url of nonce, ciphertext and tag,
//! XChaCha20-Poly1305 under a key toolgate-xds hands out) and restores it on the way in.
//!
//! A value that does not open under the key (forged, from another fleet, or from before
//! sealing was turned on) is made undecodable for the envelope, so that no client can pick an
//! instance by writing an address itself; the server then does not know the session and answers
//! 404, and the client initializes again, as the MCP specification says it must.

use base64::engine::general_purpose::STANDARD;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use chacha20poly1305::aead::{Aead, KeyInit};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};

/// Prefix of a sealed value (and of its format).
pub const PREFIX: &str = "tgs1.";
const NONCE_BYTES: usize = 24;
/// Session values longer than this are not sealed, nor accepted sealed: an id is a few dozen
/// bytes, and the client's `initialize` parameters sealed with it at most
/// [`crate::held_session::MAX_PARAMS_BYTES`].
pub const MAX_VALUE_BYTES: usize = 3072;

/// The sealing key and this VM's nonce sequence.
pub struct Sealer {
    cipher: XChaCha20Poly1305,
    /// Unique per VM: the time the VM started, then a counter. XChaCha's 192-bit nonces make
    /// uniqueness the only requirement, and VMs never share a prefix.
    prefix: [u8; 16],
    counter: u64,
}

impl Sealer {
    /// A sealer for the key (32 bytes, standard base64); `None` if it is not one.
    pub fn new(key_b64: &str, vm_seed: u128) -> Option<Sealer> {
        let key = STANDARD.decode(key_b64.trim()).ok()?;
        if key.len() != 32 {
            return None;
        }
        let cipher = XChaCha20Poly1305::new_from_slice(&key).ok()?;
        Some(Sealer {
            cipher,
            prefix: vm_seed.to_le_bytes(),
            counter: 0,
        })
    }

    /// The sealed form of a session id.
    pub fn seal(&mut self, value: &str) -> Option<String> {
        if value.len() > MAX_VALUE_BYTES {
            return None;
        }
        self.counter = self.counter.wrapping_add(1);
        let mut nonce = [0u8; NONCE_BYTES];
        nonce[..16].copy_from_slice(&self.prefix);
        nonce[16..].copy_from_slice(&self.counter.to_le_bytes());
        let sealed = self
            .cipher
            .encrypt(XNonce::from_slice(&nonce), value.as_bytes())
            .ok()?;
        let mut raw = Vec::with_capacity(NONCE_BYTES + sealed.len());
        raw.extend_from_slice(&nonce);
        raw.extend_from_slice(&sealed);
        Some(format!("{PREFIX}{}", URL_SAFE_NO_PAD.encode(raw)))
    }

    /// The session id a sealed value carries; `None` for anything this key did not seal.
    pub fn open(&self, sealed: &str) -> Option<String> {
        let encoded = sealed.strip_prefix(PREFIX)?;
        if encoded.len() > 2 * MAX_VALUE_BYTES {
            return None;
        }
        let raw = URL_SAFE_NO_PAD.decode(encoded).ok()?;
        if raw.len() < NONCE_BYTES {
            return None;
        }
        let (nonce, sealed) = raw.split_at(NONCE_BYTES);
        let plain = self
            .cipher
            .decrypt(XNonce::from_slice(nonce), sealed)
            .ok()?;
        String::from_utf8(plain).ok()
    }
}

/// What an agent's value becomes when it does not open: the envelope cannot decode it (so it
/// picks no instance), and the server sees an id it never issued.
pub fn unusable(value: &str) -> String {
    format!("!{value}")
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";

    #[test]
    fn a_sealed_id_opens_and_shows_no_address() {
        let mut s = Sealer::new(KEY, 7).expect("key");
        let envelope = "MTI3LjAuMC4xOjQ0MTE3;8c1f3a";
        let sealed = s.seal(envelope).expect("sealed");
        assert!(sealed.starts_with(PREFIX));
        assert!(!sealed.contains("MTI3"), "{sealed}");
        assert_eq!(s.open(&sealed).as_deref(), Some(envelope));
        // Header-safe: no `;`, `,`, spaces or padding.
        assert!(sealed
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)));
        let again = s.seal(envelope).expect("sealed");
        assert_ne!(again, sealed, "a fresh nonce each time");
    }

    #[test]
    fn forged_tampered_and_foreign_ids_do_not_open() {
        let mut s = Sealer::new(KEY, 7).expect("key");
        let sealed = s.seal("MTI3LjAuMC4xOjQ0MTE3;x").expect("sealed");
        let mut tampered = sealed.clone().into_bytes();
        let last = tampered.len() - 1;
        tampered[last] = if tampered[last] == b'A' { b'B' } else { b'A' };
        let other = Sealer::new("HwECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=", 7).expect("key");
        for bad in [
            "MTI3LjAuMC4xOjQ0MTE3;x",
            "tgs1.",
            "tgs1.AAAA",
            "tgs1.!!!",
            std::str::from_utf8(&tampered).expect("ascii"),
        ] {
            assert_eq!(s.open(bad), None, "{bad}");
        }
        assert_eq!(other.open(&sealed), None, "another fleet's key");
        assert_eq!(
            unusable("MTI3LjAuMC4xOjQ0MTE3;x"),
            "!MTI3LjAuMC4xOjQ0MTE3;x"
        );
    }

    #[test]
    fn keys_must_be_32_bytes_of_base64() {
        assert!(Sealer::new("", 1).is_none());
        assert!(Sealer::new("AAEC", 1).is_none());
        assert!(Sealer::new("not base64 at all", 1).is_none());
    }
}
