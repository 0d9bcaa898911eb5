//! Reading a whole prefix from etcd, in pages. etcd answers a range in one gRPC message, and
//! tonic refuses a message above 4 MiB by default: one Get of 100,000 registrations (about
//! 15 MB) failed, so the registry could not be read at all. Pages of [`PAGE_KEYS`] keys, all at
//! the revision of the first, read the same consistent state as one Get.

use std::time::Duration;

use etcd_client::{Client, GetOptions, KeyValue};

/// Keys per request: about 150 KB of registrations.
const PAGE_KEYS: i64 = 1_000;
/// Room for a page of unusually large values (etcd allows 1.5 MiB each by default).
const MAX_MESSAGE_BYTES: usize = 64 * 1024 * 1024;
/// A watch response holds every event of a revision: 100,000 registrations of one lease
/// revoked at once are about 30 MB with their previous values.
pub const MAX_WATCH_MESSAGE_BYTES: usize = 256 * 1024 * 1024;

/// Every key under `prefix` at revision `at` (`None`: the current one), with the revision
/// read. Each page must come within `timeout`. An error names the page that failed.
pub async fn get_prefix(
    client: &Client,
    prefix: &str,
    at: Option<i64>,
    timeout: Duration,
) -> Result<(Vec<KeyValue>, i64), String> {
    let mut kv = client
        .kv_client()
        .max_decoding_message_size(MAX_MESSAGE_BYTES);
    let end = prefix_end(prefix.as_bytes());
    let mut from = prefix.as_bytes().to_vec();
    let mut revision = at.filter(|r| *r > 0);
    let mut out = Vec::new();
    let mut page = 0u32;
    loop {
        page += 1;
        let mut opts = GetOptions::new()
            .with_range(end.clone())
            .with_limit(PAGE_KEYS);
        if let Some(r) = revision {
            opts = opts.with_revision(r);
        }
        let mut resp = tokio::time::timeout(timeout, kv.get(from.clone(), Some(opts)))
            .await
            .map_err(|_| format!("the Get of the prefix {prefix} timed out (page {page})"))?
            .map_err(|e| format!("the Get of the prefix {prefix} failed (page {page}): {e}"))?;
        // The first page's revision pins the rest: later writes do not tear the read.
        let read_at = *revision.get_or_insert_with(|| resp.header().map_or(0, |h| h.revision()));
        let more = resp.more();
        let kvs = resp.take_kvs();
        let Some(last) = kvs.last() else {
            return Ok((out, read_at));
        };
        // The next page starts just after the last key read.
        from = last.key().to_vec();
        from.push(0);
        out.extend(kvs);
        if !more {
            return Ok((out, read_at));
        }
    }
}

/// The smallest key above every key starting with `prefix` (etcd's range end of a prefix).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Only 0xff bytes: every key from the prefix on.
    vec![0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_range_end_of_a_prefix() {
        assert_eq!(prefix_end(b"/mcp/"), b"/mcp0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
    }
}
