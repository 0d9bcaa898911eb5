//! Incremental `text/event-stream` scanner for a streamed MCP response.
//!
//! The filter must judge a call from its SSE response without holding the stream back: chunks
//! pass on to the client as they come, and the scanner keeps only the `data` of the event being
//! read (bounded). Parsing follows the WHATWG event-stream rules: lines end in CRLF, LF or a lone
//! CR; `:` starts a comment; one space after the field's colon is dropped; the `data` lines of an
//! event are joined with `\n`; an empty line dispatches the event; an event whose type is neither
//! empty nor `message` is not delivered to an MCP client, so it is ignored too.

use super::jsonrpc::RawId;
use super::response::{classify_response, ResponseClass};

/// Largest event `data` the scanner holds before giving up on a stream (1 MiB). A result
/// larger than this is not judged, rather than letting one response grow a worker's memory.
pub const DEFAULT_MAX_EVENT_BYTES: usize = 1 << 20;

/// Capacity kept between events; a buffer grown by one large event is released after it so that
/// a long-lived stream does not pin its peak.
const KEEP_CAPACITY: usize = 64 * 1024;

const BOM: &[u8] = b"\xEF\xBB\xBF";

/// Finds the JSON-RPC response to one request in an SSE stream fed chunk by chunk.
#[derive(Debug)]
pub struct SseScanner {
    id: RawId,
    max_event_bytes: usize,
    state: LineState,
    /// The previous byte was a CR ending a line: a following LF belongs to the same line end.
    after_cr: bool,
    /// Bytes of a leading UTF-8 BOM matched so far; `BOM.len()` once the stream start is past.
    bom_matched: usize,
    /// Field name of the current line, up to the longest name the scanner cares about.
    name: [u8; 5],
    name_len: usize,
    /// The name is longer than any field the scanner reads.
    name_long: bool,
    data: Vec<u8>,
    data_lines: usize,
    /// Value of the current event's last `event` field, long enough to tell `message` apart.
    event_type: [u8; 8],
    event_type_len: usize,
    event_type_long: bool,
    done: bool,
    /// Whether to keep the ids of the server's own requests (`noting_requests`).
    noting: bool,
    /// Ids (raw JSON) of the requests the server made in the events read since the last
    /// `take_requests`, at most [`MAX_NOTED`].
    requests: Vec<String>,
}

/// Server requests kept between two `take_requests`: a call's stream carries a few.
const MAX_NOTED: usize = 16;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LineState {
    /// At the start of a line.
    Start,
    /// Reading a field name.
    Name,
    /// After `field:`, where one space is dropped.
    SkipSpace(Field),
    Value(Field),
    /// A comment or a field the scanner does not read: skipped to the end of the line.
    Ignore,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Field {
    Data,
    Event,
}

impl SseScanner {
    /// A scanner for the response to request `id`, holding at most [`DEFAULT_MAX_EVENT_BYTES`].
    pub fn new(id: RawId) -> Self {
        Self::with_limit(id, DEFAULT_MAX_EVENT_BYTES)
    }

    /// A scanner holding at most `max_event_bytes` of one event's data.
    pub fn with_limit(id: RawId, max_event_bytes: usize) -> Self {
        SseScanner {
            id,
            max_event_bytes,
            state: LineState::Start,
            after_cr: false,
            bom_matched: 0,
            name: [0; 5],
            name_len: 0,
            name_long: false,
            data: Vec::new(),
            data_lines: 0,
            event_type: [0; 8],
            event_type_len: 0,
            event_type_long: false,
            done: false,
            noting: false,
            requests: Vec::new(),
        }
    }

    /// Also keeps the ids of the requests the server makes on the stream (its questions to
    /// the client: see `crate::asked`).
    pub fn noting_requests(mut self) -> Self {
        self.noting = true;
        self
    }

    /// The ids of the server's requests read since the last call.
    pub fn take_requests(&mut self) -> Vec<String> {
        std::mem::take(&mut self.requests)
    }

    /// Scans the next chunk; returns the classification once the event carrying the response to
    /// this request is complete, and `None` before that and after it. Returns
    /// [`ResponseClass::TooLarge`] once when an event outgrows the limit, and stops scanning.
    pub fn feed(&mut self, chunk: &[u8]) -> Option<ResponseClass> {
        let mut i = 0;
        while i < chunk.len() && !self.done {
            if self.bom_matched < BOM.len() {
                i += self.skip_bom(&chunk[i..]);
                continue;
            }
            let b = chunk[i];
            if self.after_cr {
                self.after_cr = false;
                if b == b'\n' {
                    i += 1;
                    continue;
                }
            }
            match self.state {
                LineState::Start => match b {
                    b'\r' | b'\n' => {
                        self.after_cr = b == b'\r';
                        i += 1;
                        if let Some(class) = self.dispatch() {
                            return Some(class);
                        }
                    }
                    b':' => {
                        self.state = LineState::Ignore;
                        i += 1;
                    }
                    _ => {
                        self.state = LineState::Name;
                        self.name_len = 0;
                        self.name_long = false;
                    }
                },
                LineState::Name => match b {
                    b'\r' | b'\n' => {
                        // A line without a colon is a field with an empty value.
                        if let Some(field) = self.field() {
                            if let Some(class) = self.begin_value(field) {
                                return Some(class);
                            }
                        }
                        self.end_line(b);
                        i += 1;
                    }
                    b':' => {
                        self.state = match self.field() {
                            Some(field) => LineState::SkipSpace(field),
                            None => LineState::Ignore,
                        };
                        i += 1;
                    }
                    _ => {
                        self.push_name(b);
                        i += 1;
                    }
                },
                LineState::SkipSpace(field) => {
                    if b == b' ' {
                        i += 1;
                    }
                    self.state = LineState::Value(field);
                    if let Some(class) = self.begin_value(field) {
                        return Some(class);
                    }
                }
                LineState::Value(_) | LineState::Ignore => {
                    let rest = &chunk[i..];
                    let eol = rest.iter().position(|&c| c == b'\r' || c == b'\n');
                    let value = &rest[..eol.unwrap_or(rest.len())];
                    if let Some(class) = self.push_value(value) {
                        return Some(class);
                    }
                    match eol {
                        Some(at) => {
                            self.end_line(rest[at]);
                            i += at + 1;
                        }
                        None => i = chunk.len(),
                    }
                }
            }
        }
        None
    }

    /// Ends the stream: `None` if [`feed`](Self::feed) already reported, otherwise
    /// [`ResponseClass::Other`] (the stream closed without the response to this request; an
    /// unterminated last event is discarded, as an event-stream client would).
    pub fn finish(&mut self) -> Option<ResponseClass> {
        if self.done {
            return None;
        }
        self.done = true;
        self.data = Vec::new();
        Some(ResponseClass::Other)
    }

    /// Consumes bytes of a leading BOM; returns how many bytes of `chunk` it used.
    fn skip_bom(&mut self, chunk: &[u8]) -> usize {
        let mut used = 0;
        while self.bom_matched < BOM.len() && used < chunk.len() {
            if chunk[used] != BOM[self.bom_matched] {
                if self.bom_matched > 0 {
                    // A broken BOM cannot start a field the scanner reads; the line is skipped.
                    self.state = LineState::Name;
                    self.name_long = true;
                }
                self.bom_matched = BOM.len();
                return used;
            }
            self.bom_matched += 1;
            used += 1;
        }
        used
    }

    fn push_name(&mut self, b: u8) {
        if self.name_len < self.name.len() {
            self.name[self.name_len] = b;
            self.name_len += 1;
        } else {
            self.name_long = true;
        }
    }

    fn field(&self) -> Option<Field> {
        if self.name_long {
            return None;
        }
        match &self.name[..self.name_len] {
            b"data" => Some(Field::Data),
            b"event" => Some(Field::Event),
            // `id` and `retry` only matter for reconnecting, which the filter never does.
            _ => None,
        }
    }

    /// Starts a field's value; for `data`, the `\n` joining it to the previous line counts
    /// against the limit too, or a stream of empty `data` lines would grow without bound.
    fn begin_value(&mut self, field: Field) -> Option<ResponseClass> {
        match field {
            Field::Data => {
                if self.data_lines > 0 {
                    if let Some(class) = self.push_data(b"\n") {
                        return Some(class);
                    }
                }
                self.data_lines += 1;
            }
            Field::Event => {
                self.event_type_len = 0;
                self.event_type_long = false;
            }
        }
        None
    }

    fn push_data(&mut self, bytes: &[u8]) -> Option<ResponseClass> {
        if self.data.len().saturating_add(bytes.len()) > self.max_event_bytes {
            self.done = true;
            self.data = Vec::new();
            return Some(ResponseClass::TooLarge);
        }
        self.data.extend_from_slice(bytes);
        None
    }

    /// Appends part of the current line's value; gives up when the event's data grows too big.
    fn push_value(&mut self, value: &[u8]) -> Option<ResponseClass> {
        match self.state {
            LineState::Value(Field::Data) => return self.push_data(value),
            LineState::Value(Field::Event) => {
                let room = self.event_type.len() - self.event_type_len;
                if value.len() > room {
                    self.event_type_long = true;
                } else {
                    self.event_type[self.event_type_len..self.event_type_len + value.len()]
                        .copy_from_slice(value);
                    self.event_type_len += value.len();
                }
            }
            _ => {}
        }
        None
    }

    fn end_line(&mut self, eol: u8) {
        self.after_cr = eol == b'\r';
        self.state = LineState::Start;
    }

    /// Handles the blank line that ends an event.
    fn dispatch(&mut self) -> Option<ResponseClass> {
        let has_data = self.data_lines > 0;
        let is_message = !self.event_type_long
            && matches!(&self.event_type[..self.event_type_len], b"" | b"message");
        self.data_lines = 0;
        self.event_type_len = 0;
        self.event_type_long = false;
        let class = if has_data && is_message {
            classify_response(&self.data, &self.id)
        } else {
            ResponseClass::Other
        };
        if self.noting && has_data && is_message && class == ResponseClass::Other {
            if let Some(id) = server_request_id(&self.data) {
                if self.requests.len() < MAX_NOTED {
                    self.requests.push(id);
                }
            }
        }
        self.data.clear();
        if self.data.capacity() > KEEP_CAPACITY {
            self.data = Vec::new();
        }
        match class {
            // Notifications, server requests, other ids; and events whose data is not JSON,
            // whose id cannot be known: the response may still follow.
            ResponseClass::Other | ResponseClass::Unparseable => None,
            found => {
                self.done = true;
                self.data = Vec::new();
                Some(found)
            }
        }
    }
}

/// The id (raw JSON) of a JSON-RPC request: an object with both `method` and `id`, each once.
fn server_request_id(data: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Request<'a> {
        #[serde(borrow)]
        id: Option<&'a serde_json::value::RawValue>,
        method: Option<serde::de::IgnoredAny>,
    }
    let request: Request<'_> = serde_json::from_slice(data).ok()?;
    request.method?;
    let id = request.id?.get();
    (id != "null").then(|| id.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scanner() -> SseScanner {
        SseScanner::new(RawId::from_json("\"req-1\"").expect("id"))
    }

    const RESPONSE: &str =
        r#"{"jsonrpc":"2.0","id":"req-1","result":{"content":[],"isError":true}}"#;
    const HIT: ResponseClass = ResponseClass::Result { is_error: true };

    fn stream() -> String {
        format!(
            ": keep-alive\r\n\r\nevent: message\nid: 1\ndata: {{\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{{\"progress\":1}}}}\n\n\
             data: {{\"jsonrpc\":\"2.0\",\"id\":\"req-1\",\"method\":\"sampling/createMessage\"}}\n\n\
             event: endpoint\ndata: {RESPONSE}\n\n\
             retry: 10\r\ndata: {}\r\ndata: {}\r\n\r\ndata: {{\"id\":\"other\",\"result\":{{}}}}\n\n",
            &RESPONSE[..30],
            &RESPONSE[30..]
        )
    }

    #[test]
    fn finds_the_response_after_notifications_comments_and_foreign_events() {
        let mut s = scanner();
        assert_eq!(
            s.feed(stream().as_bytes()),
            Some(ResponseClass::Result { is_error: true })
        );
        assert_eq!(s.feed(b"data: more\n\n"), None);
        assert_eq!(s.finish(), None);
    }

    #[test]
    fn multi_line_data_is_joined_with_newlines() {
        // The response is split over two data lines at a point where `\n` is JSON whitespace.
        let mut s = scanner();
        let body = "data: {\"jsonrpc\":\"2.0\",\r\ndata:\"id\":\"req-1\",\"error\":{\"code\":-32603,\"message\":\"x\"}}\r\n\r\n";
        assert_eq!(
            s.feed(body.as_bytes()),
            Some(ResponseClass::Error { code: -32603 })
        );
    }

    #[test]
    fn every_split_point_gives_the_same_answer() {
        let whole = stream();
        let bytes = whole.as_bytes();
        for at in 0..=bytes.len() {
            let mut s = scanner();
            let first = s.feed(&bytes[..at]);
            let found = first.or_else(|| s.feed(&bytes[at..]));
            assert_eq!(found, Some(HIT), "split at {at}");
        }
    }

    #[test]
    fn byte_by_byte_feeding_finds_the_response() {
        for ending in ["\n", "\r\n", "\r"] {
            let text = format!(":c{e}data: {RESPONSE}{e}{e}", e = ending);
            let mut s = scanner();
            let mut found = None;
            for b in text.as_bytes() {
                if let Some(c) = s.feed(std::slice::from_ref(b)) {
                    found = Some(c);
                }
            }
            assert_eq!(found, Some(HIT), "{ending:?}");
        }
    }

    #[test]
    fn a_leading_bom_is_skipped() {
        let text = format!("\u{feff}data: {RESPONSE}\n\n");
        let bytes = text.as_bytes();
        for at in 0..=bytes.len() {
            let mut s = scanner();
            let found = s.feed(&bytes[..at]).or_else(|| s.feed(&bytes[at..]));
            assert_eq!(found, Some(HIT), "split at {at}");
        }
    }

    #[test]
    fn fields_without_the_optional_space_and_without_colon() {
        let mut s = scanner();
        assert_eq!(s.feed(format!("data:{RESPONSE}\n\n").as_bytes()), Some(HIT));
        // `data` alone is an empty data line: the event's data is "\n" + response.
        let mut s = scanner();
        assert_eq!(
            s.feed(format!("data\ndata: {RESPONSE}\n\n").as_bytes()),
            Some(HIT)
        );
        // Two spaces: only one is dropped, and JSON tolerates the other.
        let mut s = scanner();
        assert_eq!(
            s.feed(format!("data:  {RESPONSE}\n\n").as_bytes()),
            Some(HIT)
        );
    }

    #[test]
    fn non_message_events_and_lookalike_fields_are_ignored() {
        let mut s = scanner();
        let text = format!(
            "event: ping\ndata: {RESPONSE}\n\nevent: messages\ndata: {RESPONSE}\n\ndatax: {RESPONSE}\n\ndat: {RESPONSE}\n\n: data: {RESPONSE}\n\n"
        );
        assert_eq!(s.feed(text.as_bytes()), None);
        // An unterminated event is discarded at end of stream.
        assert_eq!(s.feed(format!("data: {RESPONSE}\n").as_bytes()), None);
        assert_eq!(s.finish(), Some(ResponseClass::Other));
        assert_eq!(s.finish(), None);
    }

    #[test]
    fn event_type_resets_between_events() {
        let mut s = scanner();
        let text = format!("event: ping\ndata: x\n\ndata: {RESPONSE}\n\n");
        assert_eq!(s.feed(text.as_bytes()), Some(HIT));
    }

    #[test]
    fn unparseable_events_do_not_end_the_scan() {
        let mut s = scanner();
        let text = format!("data: <html>\n\ndata: {RESPONSE}\n\n");
        assert_eq!(s.feed(text.as_bytes()), Some(HIT));
    }

    #[test]
    fn an_event_over_the_limit_gives_up_once() {
        let mut s = SseScanner::with_limit(RawId::from_json("\"req-1\"").expect("id"), 64);
        assert_eq!(s.feed(b"data: "), None);
        assert_eq!(s.feed(&[b'x'; 40]), None);
        assert_eq!(s.feed(b"\ndata: "), None);
        assert_eq!(s.feed(&[b'x'; 40]), Some(ResponseClass::TooLarge));
        assert_eq!(s.feed(format!("\n\ndata: {RESPONSE}\n\n").as_bytes()), None);
        assert_eq!(s.finish(), None);
    }

    #[test]
    fn empty_data_lines_count_against_the_limit() {
        let mut s = SseScanner::with_limit(RawId::from_json("1").expect("id"), 64);
        let mut found = None;
        for _ in 0..100 {
            found = found.or(s.feed(b"data\n"));
        }
        assert_eq!(found, Some(ResponseClass::TooLarge));
    }

    #[test]
    fn long_streams_of_small_events_do_not_accumulate() {
        let mut s = SseScanner::with_limit(RawId::from_json("1").expect("id"), 128);
        let note = b"data: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\"}\n\n";
        for _ in 0..10_000 {
            assert_eq!(s.feed(note), None);
        }
        assert_eq!(
            s.feed(b"data: {\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{}}\n\n"),
            Some(ResponseClass::Result { is_error: false })
        );
    }

    #[test]
    fn the_servers_own_requests_are_noted_when_asked() {
        let stream = concat!(
            "data: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\",\"params\":{}}\n\n",
            "data: {\"jsonrpc\":\"2.0\",\"id\":0,\"method\":\"elicitation/create\",\"params\":{}}\n\n",
            "data: {\"jsonrpc\":\"2.0\",\"id\":\"s-1\",\"method\":\"sampling/createMessage\"}\n\n",
            "data: {\"jsonrpc\":\"2.0\",\"id\":2,\"id\":3,\"method\":\"x\"}\n\n",
            "data: {\"jsonrpc\":\"2.0\",\"id\":\"req-1\",\"result\":{\"content\":[]}}\n\n",
        );
        let mut noting = scanner().noting_requests();
        assert!(matches!(
            noting.feed(stream.as_bytes()),
            Some(ResponseClass::Result { is_error: false })
        ));
        assert_eq!(
            noting.take_requests(),
            vec!["0".to_string(), "\"s-1\"".to_string()]
        );
        assert!(noting.take_requests().is_empty());
        let mut plain = scanner();
        assert!(plain.feed(stream.as_bytes()).is_some());
        assert!(plain.take_requests().is_empty());
    }
}
