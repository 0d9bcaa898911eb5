//! A header map as proxy-wasm hands it over in one host call (`proxy_get_header_map_pairs`):
//! the filter reads each map it needs once per callback, instead of one host call per header
//! (each crossing out of the VM costs about a microsecond, and a header that is
//! present costs a second crossing, into the VM, to allocate its copy).
//!
//! The ABI's serialization: the number of pairs (u32, little endian), then each pair's key and
//! value lengths (two u32), then each key and value followed by a NUL byte. The bytes are kept
//! as they came and read in place; nothing is copied per header.

/// The serialized pairs of one header map. A map the host serialized wrongly reads as empty
/// (every lookup `None`), never panics.
#[derive(Debug, Default, Clone)]
pub struct HeaderMap {
    bytes: Vec<u8>,
    /// (key start, key length, value start, value length) per pair, in the host's order.
    spans: Vec<(u32, u32, u32, u32)>,
}

impl HeaderMap {
    pub fn parse(bytes: Vec<u8>) -> HeaderMap {
        let spans = spans(&bytes).unwrap_or_default();
        HeaderMap { bytes, spans }
    }

    /// The first value of header `name`, if present and UTF-8. Names match regardless of case,
    /// as Envoy's own lookup (`LowerCaseString`) does.
    pub fn get(&self, name: &str) -> Option<&str> {
        let name = name.as_bytes();
        self.spans.iter().find_map(|&(k, kl, v, vl)| {
            let key = self.bytes.get(k as usize..(k + kl) as usize)?;
            if !key.eq_ignore_ascii_case(name) {
                return None;
            }
            let value = self.bytes.get(v as usize..(v + vl) as usize)?;
            std::str::from_utf8(value).ok()
        })
    }

    /// Whether header `name` is present, whatever its value holds: a value that is not UTF-8
    /// is invisible to [`HeaderMap::get`], but a server may still read it.
    pub fn contains(&self, name: &str) -> bool {
        let name = name.as_bytes();
        self.spans.iter().any(|&(k, kl, _, _)| {
            self.bytes
                .get(k as usize..(k + kl) as usize)
                .is_some_and(|key| key.eq_ignore_ascii_case(name))
        })
    }

    /// Records a change the filter made through another host call, so that later reads in
    /// the same callback see it (`None`: removed).
    pub fn set(&mut self, name: &str, value: Option<&str>) {
        self.spans.retain(|&(k, kl, _, _)| {
            !self
                .bytes
                .get(k as usize..(k + kl) as usize)
                .is_some_and(|key| key.eq_ignore_ascii_case(name.as_bytes()))
        });
        let Some(value) = value else { return };
        let k = self.bytes.len() as u32;
        self.bytes.extend_from_slice(name.as_bytes());
        let v = self.bytes.len() as u32;
        self.bytes.extend_from_slice(value.as_bytes());
        self.spans
            .insert(0, (k, name.len() as u32, v, value.len() as u32));
    }
}

fn read_u32(bytes: &[u8], at: usize) -> Option<u32> {
    let b = bytes.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

fn spans(bytes: &[u8]) -> Option<Vec<(u32, u32, u32, u32)>> {
    if bytes.is_empty() {
        return Some(Vec::new());
    }
    let n = read_u32(bytes, 0)? as usize;
    // Each pair takes at least 8 bytes of sizes and two NULs: a count beyond that is garbage.
    if n > bytes.len() / 10 {
        return None;
    }
    let mut out = Vec::with_capacity(n);
    let mut p = 4 + n * 8;
    for i in 0..n {
        let key_len = read_u32(bytes, 4 + i * 8)?;
        let value_len = read_u32(bytes, 8 + i * 8)?;
        let key_at = p;
        let value_at = key_at.checked_add(key_len as usize)?.checked_add(1)?;
        p = value_at.checked_add(value_len as usize)?.checked_add(1)?;
        if p > bytes.len() {
            return None;
        }
        out.push((key_at as u32, key_len, value_at as u32, value_len));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn serialize(pairs: &[(&str, &str)]) -> Vec<u8> {
        let mut out = (pairs.len() as u32).to_le_bytes().to_vec();
        for (k, v) in pairs {
            out.extend_from_slice(&(k.len() as u32).to_le_bytes());
            out.extend_from_slice(&(v.len() as u32).to_le_bytes());
        }
        for (k, v) in pairs {
            out.extend_from_slice(k.as_bytes());
            out.push(0);
            out.extend_from_slice(v.as_bytes());
            out.push(0);
        }
        out
    }

    #[test]
    fn reads_the_first_value_of_a_header() {
        let m = HeaderMap::parse(serialize(&[
            (":path", "/mcp/orders"),
            ("accept", "application/json"),
            ("x-dup", "one"),
            ("x-dup", "two"),
            ("empty", ""),
        ]));
        assert_eq!(m.get(":path"), Some("/mcp/orders"));
        assert_eq!(m.get("accept"), Some("application/json"));
        assert_eq!(m.get("x-dup"), Some("one"));
        assert_eq!(m.get("Accept"), Some("application/json"));
        assert_eq!(m.get("empty"), Some(""));
        assert_eq!(m.get("missing"), None);
        assert_eq!(m.get("x-du"), None);
    }

    #[test]
    fn a_value_that_is_not_text_is_present_but_unread() {
        let mut bytes = serialize(&[("x-toolgate-cluster", "ab")]);
        // The value's first byte becomes 0xff: no longer UTF-8.
        let at = bytes.len() - 3;
        bytes[at] = 0xff;
        let m = HeaderMap::parse(bytes);
        assert_eq!(m.get("x-toolgate-cluster"), None);
        assert!(m.contains("X-Toolgate-Cluster"));
        assert!(!m.contains("x-toolgate"));
    }

    #[test]
    fn changes_made_through_the_host_show_in_later_reads() {
        let mut m = HeaderMap::parse(serialize(&[("a", "1"), ("b", "2"), ("a", "3")]));
        m.set("a", Some("new"));
        assert_eq!(m.get("a"), Some("new"));
        m.set("b", None);
        assert_eq!(m.get("b"), None);
        m.set("c", Some("x"));
        assert_eq!(m.get("c"), Some("x"));
        m.set("X-Caller", Some("alice"));
        assert_eq!(m.get("x-caller"), Some("alice"));
        m.set("x-CALLER", None);
        assert_eq!(m.get("X-Caller"), None);
        assert_eq!(m.get("a"), Some("new"));
    }

    #[test]
    fn a_map_serialized_wrongly_reads_as_empty() {
        let good = serialize(&[(":status", "200"), ("content-type", "application/json")]);
        for cut in 0..good.len() {
            let m = HeaderMap::parse(good[..cut].to_vec());
            // A truncated map is refused whole, or (cut inside the trailing NUL) still read.
            if let Some(v) = m.get("content-type") {
                assert_eq!(v, "application/json");
            }
        }
        let mut huge = good.clone();
        huge[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(HeaderMap::parse(huge).get(":status"), None);
        let mut long_key = good;
        long_key[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(HeaderMap::parse(long_key).get(":status"), None);
        assert_eq!(HeaderMap::parse(Vec::new()).get(":status"), None);
    }
}
