//! An incremental reader of `text/event-stream` bodies: bytes in, the `data` of each complete
//! event out. Only what MCP uses: `data:` lines (joined by newlines), events ended by a blank
//! line, CR LF or LF line ends; ids, retries and comments are skipped.

#[derive(Default)]
pub struct SseScanner {
    pending: Vec<u8>,
    data: Option<String>,
}

impl SseScanner {
    /// Feeds `chunk`; returns the data of every event it completed.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<String> {
        self.pending.extend_from_slice(chunk);
        let mut events = Vec::new();
        while let Some(end) = self.pending.iter().position(|&b| b == b'\n') {
            let mut line: Vec<u8> = self.pending.drain(..=end).collect();
            line.pop();
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            let line = String::from_utf8_lossy(&line);
            if line.is_empty() {
                if let Some(data) = self.data.take() {
                    events.push(data);
                }
            } else if let Some(value) = line.strip_prefix("data:") {
                let value = value.strip_prefix(' ').unwrap_or(value);
                match &mut self.data {
                    Some(data) => {
                        data.push('\n');
                        data.push_str(value);
                    }
                    None => self.data = Some(value.to_string()),
                }
            }
        }
        events
    }

    /// Bytes held for an event not yet complete (a bound for hostile streams).
    pub fn buffered(&self) -> usize {
        self.pending.len() + self.data.as_ref().map_or(0, String::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_anywhere_come_out_whole() {
        let stream =
            b"id: 1\r\nevent: message\r\ndata: {\"a\":\r\ndata: 1}\r\n\r\n: comment\n\ndata:x\n\n";
        for split in 0..stream.len() {
            let mut s = SseScanner::default();
            let mut out = s.push(&stream[..split]);
            out.extend(s.push(&stream[split..]));
            assert_eq!(out, ["{\"a\":\n1}", "x"], "split at {split}");
        }
    }
}
