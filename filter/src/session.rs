//! Sealing `Mcp-Session-Id`.
//!
//! Envoy's session affinity (the stateful-session filter's envelope) writes the upstream
//! instance's address into the session id the agent gets back (`base64(ip:port);<server's id>`):
//! every client would learn the addresses behind the gateway. The filter sits before that
//! filter, so it sees the envelope on the way out and the agent's value on the way in: it
//! encrypts the whole value on the way out (`tgs1.` and base64url of nonce, ciphertext and tag,
//! XChaCha20-Poly1305 under a key toolgate-xds hands out) and restores it on the way in.
//!
//! - Nonces are 24 random bytes from the host's CSPRNG (WASI `random_get`): with 192 bits,
//!   random nonces never repeat in practice, across VMs, restarts and gateways. When the host
//!   has no randomness to give, nothing is sealed (the id is dropped), never sealed under a
//!   guessable nonce.
//! - The associated data is `tgs1.` and the service: an id sealed for one service does not
//!   open on another's route, and no `tgs1.` id opens as one of toolgate-xds's `tgv1.`
//!   gateway sessions (sealed with the same key, associated data `tgv1`), nor the reverse.
//!
//! A value that does not open under the key (forged, from another fleet, for another service,
//! or from before sealing was turned on) is made undecodable for the envelope, so that no
//! client can pick an instance by writing an address itself; the server then does not know the
//! session and answers 404, and the client initializes again, as the MCP specification says it
//! must.

use base64::engine::general_purpose::STANDARD;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};

/// Prefix of a sealed value (and of its format).
pub const PREFIX: &str = "tgs1.";
const NONCE_BYTES: usize = 24;
/// Session values longer than this are not sealed, nor accepted sealed: an id is a few dozen
/// bytes, and the client's `initialize` parameters sealed with it at most
/// [`crate::held_session::MAX_PARAMS_BYTES`].
pub const MAX_VALUE_BYTES: usize = 3072;

/// The sealing key.
pub struct Sealer {
    cipher: XChaCha20Poly1305,
}

/// What binds a sealed id: its format and the service whose route issued it.
fn associated_data(service: &str) -> Vec<u8> {
    [PREFIX.as_bytes(), service.as_bytes()].concat()
}

impl Sealer {
    /// A sealer for the key (32 bytes, standard base64); `None` if it is not one.
    pub fn new(key_b64: &str) -> Option<Sealer> {
        let key = STANDARD.decode(key_b64.trim()).ok()?;
        if key.len() != 32 {
            return None;
        }
        let cipher = XChaCha20Poly1305::new_from_slice(&key).ok()?;
        Some(Sealer { cipher })
    }

    /// The sealed form of a session id of `service`; `None` when it is too long, or the host
    /// gave no random nonce.
    pub fn seal(&self, value: &str, service: &str) -> Option<String> {
        if value.len() > MAX_VALUE_BYTES {
            return None;
        }
        self.seal_as(PREFIX, &associated_data(service), value.as_bytes())
    }

    /// `plain` sealed under this key with a random nonce and `aad`, written as `prefix` and
    /// base64url of nonce, ciphertext and tag: the format of `tgs1.` ids and of toolgate-xds's
    /// `tgv1.` gateway sessions alike.
    pub fn seal_as(&self, prefix: &str, aad: &[u8], plain: &[u8]) -> Option<String> {
        let mut nonce = [0u8; NONCE_BYTES];
        getrandom::fill(&mut nonce).ok()?;
        let sealed = self
            .cipher
            .encrypt(XNonce::from_slice(&nonce), Payload { msg: plain, aad })
            .ok()?;
        let mut raw = Vec::with_capacity(NONCE_BYTES + sealed.len());
        raw.extend_from_slice(&nonce);
        raw.extend_from_slice(&sealed);
        Some(format!("{prefix}{}", URL_SAFE_NO_PAD.encode(raw)))
    }

    /// The session id a sealed value carries; `None` for anything this key did not seal for
    /// `service`.
    pub fn open(&self, sealed: &str, service: &str) -> Option<String> {
        let encoded = sealed.strip_prefix(PREFIX)?;
        if encoded.len() > 2 * MAX_VALUE_BYTES {
            return None;
        }
        let raw = URL_SAFE_NO_PAD.decode(encoded).ok()?;
        if raw.len() < NONCE_BYTES {
            return None;
        }
        let (nonce, sealed) = raw.split_at(NONCE_BYTES);
        let aad = associated_data(service);
        let plain = self
            .cipher
            .decrypt(
                XNonce::from_slice(nonce),
                Payload {
                    msg: sealed,
                    aad: &aad,
                },
            )
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
        let s = Sealer::new(KEY).expect("key");
        let envelope = "MTI3LjAuMC4xOjQ0MTE3;8c1f3a";
        let sealed = s.seal(envelope, "orders").expect("sealed");
        assert!(sealed.starts_with(PREFIX));
        assert!(!sealed.contains("MTI3"), "{sealed}");
        assert_eq!(s.open(&sealed, "orders").as_deref(), Some(envelope));
        assert_eq!(s.open(&sealed, "billing"), None, "bound to its service");
        // Header-safe: no `;`, `,`, spaces or padding.
        assert!(sealed
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)));
        let again = s.seal(envelope, "orders").expect("sealed");
        assert_ne!(again, sealed, "a fresh nonce each time");
    }

    #[test]
    fn forged_tampered_and_foreign_ids_do_not_open() {
        let s = Sealer::new(KEY).expect("key");
        let sealed = s.seal("MTI3LjAuMC4xOjQ0MTE3;x", "orders").expect("sealed");
        let mut tampered = sealed.clone().into_bytes();
        let last = tampered.len() - 1;
        tampered[last] = if tampered[last] == b'A' { b'B' } else { b'A' };
        let other = Sealer::new("HwECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=").expect("key");
        for bad in [
            "MTI3LjAuMC4xOjQ0MTE3;x",
            "tgs1.",
            "tgs1.AAAA",
            "tgs1.!!!",
            std::str::from_utf8(&tampered).expect("ascii"),
        ] {
            assert_eq!(s.open(bad, "orders"), None, "{bad}");
        }
        assert_eq!(other.open(&sealed, "orders"), None, "another fleet's key");
        assert_eq!(
            unusable("MTI3LjAuMC4xOjQ0MTE3;x"),
            "!MTI3LjAuMC4xOjQ0MTE3;x"
        );
    }

    #[test]
    fn a_gateway_session_sealed_with_the_same_key_never_opens_here() {
        // toolgate-xds seals its `tgv1.` ids with the same key and associated data `tgv1`.
        let cipher =
            XChaCha20Poly1305::new_from_slice(&STANDARD.decode(KEY).expect("key")).expect("cipher");
        let nonce = [9u8; NONCE_BYTES];
        let value = "MTI3LjAuMC4xOjQ0MTE3;x";
        let sealed = cipher
            .encrypt(
                XNonce::from_slice(&nonce),
                Payload {
                    msg: value.as_bytes(),
                    aad: b"tgv1",
                },
            )
            .expect("sealed");
        let forged = format!(
            "{PREFIX}{}",
            URL_SAFE_NO_PAD.encode([nonce.as_slice(), &sealed].concat())
        );
        let s = Sealer::new(KEY).expect("key");
        for service in ["orders", "", "tgv1"] {
            assert_eq!(s.open(&forged, service), None, "{service}");
        }
    }

    #[test]
    fn keys_must_be_32_bytes_of_base64() {
        assert!(Sealer::new("").is_none());
        assert!(Sealer::new("AAEC").is_none());
        assert!(Sealer::new("not base64 at all").is_none());
    }
}
