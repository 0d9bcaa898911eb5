//! Newline-delimited messages read with a bound: a line longer than the limit is reported
//! as soon as the limit is passed, never held whole, so a server that writes 100 MiB without a
//! newline costs the bridge at most the limit.

use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};

/// One read of the stream.
#[derive(Debug, PartialEq, Eq)]
pub enum Line {
    /// A line without its `\n` (and a `\r` before it).
    Text(Vec<u8>),
    /// A line passed the limit; what was read of it is dropped.
    TooLong,
}

pub struct LineReader<R> {
    inner: BufReader<R>,
    max: usize,
    /// What was read of the current line: kept here, so that a read given up in a `select!`
    /// loses nothing.
    partial: Vec<u8>,
}

impl<R: AsyncRead + Unpin> LineReader<R> {
    pub fn new(inner: R, max: usize) -> Self {
        LineReader {
            inner: BufReader::with_capacity(64 * 1024, inner),
            max,
            partial: Vec::new(),
        }
    }

    /// The next line; `None` at the end of the stream. A last line without a newline counts.
    /// Cancel-safe.
    pub async fn next(&mut self) -> std::io::Result<Option<Line>> {
        loop {
            let available = self.inner.fill_buf().await?;
            if available.is_empty() {
                let line = std::mem::take(&mut self.partial);
                return Ok((!line.is_empty()).then_some(Line::Text(line)));
            }
            let (take, done) = match available.iter().position(|b| *b == b'\n') {
                Some(i) => (i, true),
                None => (available.len(), false),
            };
            if self.partial.len() + take > self.max {
                let consumed = if done { take + 1 } else { take };
                self.inner.consume(consumed);
                self.partial = Vec::new();
                return Ok(Some(Line::TooLong));
            }
            self.partial.extend_from_slice(&available[..take]);
            self.inner.consume(if done { take + 1 } else { take });
            if done {
                let mut line = std::mem::take(&mut self.partial);
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                return Ok(Some(Line::Text(line)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn all(input: &[u8], max: usize) -> Vec<Line> {
        let mut r = LineReader::new(input, max);
        let mut out = Vec::new();
        while let Some(l) = r.next().await.expect("read") {
            out.push(l);
        }
        out
    }

    #[tokio::test]
    async fn lines_are_split_and_a_last_line_without_newline_counts() {
        assert_eq!(
            all(b"a\r\nbc\n\nd", 10).await,
            vec![
                Line::Text(b"a".to_vec()),
                Line::Text(b"bc".to_vec()),
                Line::Text(vec![]),
                Line::Text(b"d".to_vec())
            ]
        );
        assert!(all(b"", 10).await.is_empty());
    }

    #[tokio::test]
    async fn a_line_past_the_limit_is_reported_without_being_held() {
        let mut input = vec![b'x'; 1000];
        input.extend_from_slice(b"\nok\n");
        let mut r = LineReader::new(&input[..], 100);
        assert_eq!(r.next().await.expect("read"), Some(Line::TooLong));
        // Exactly the limit is fine.
        assert_eq!(
            all(&[b'y'; 100], 100).await,
            vec![Line::Text(vec![b'y'; 100])]
        );
        assert_eq!(all(&[b'y'; 101], 100).await, vec![Line::TooLong]);
    }
}
