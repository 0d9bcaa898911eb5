//! A server's own answer to `tools/list` on its service's route, with each tool this gateway
//! would refuse right now annotated as the aggregate endpoint annotates it
//! ([`toolgate_model::availability`]).
//!
//! Only what must change is rebuilt: the message and its result are read as ordered lists of
//! raw members, each tool only as far as its `name`, and a tool is parsed whole only when it
//! is annotated. A listing with nothing to annotate is left as the server sent it, byte for
//! byte; a rewritten one keeps every other member and every other tool as it was.

use std::fmt;

use serde::de::{Deserializer, MapAccess, Visitor};
use serde::ser::{SerializeMap, Serializer};
use serde::{Deserialize, Serialize};
use serde_json::value::{to_raw_value, RawValue};
use serde_json::{Map, Value};
use toolgate_model::availability::{annotate, Availability};

use super::jsonrpc::{first_non_ws, RawId, Str};

/// What became of one JSON-RPC message read as the answer to a `tools/list`.
#[derive(Debug, PartialEq, Eq)]
pub enum Listed {
    /// Not the response to this request (another id, a notification, a server's request):
    /// in an SSE stream, the next event may be.
    NotTheResponse,
    /// The response, but not one the gateway can read as a listing (not JSON, no `tools`
    /// array): passed as it is.
    Unread,
    /// A listing (or an error) with nothing to annotate: passed as it is.
    Unchanged,
    /// The listing with `annotated` tools annotated and `hidden` tools left out.
    Annotated {
        body: Vec<u8>,
        annotated: usize,
        hidden: usize,
    },
}

/// Which listing an answer is: where its items are and what names each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listing {
    Tools,
    Resources,
    Templates,
    Prompts,
}

impl Listing {
    pub fn of_method(method: &str) -> Option<Listing> {
        match method {
            "tools/list" => Some(Listing::Tools),
            "resources/list" => Some(Listing::Resources),
            "resources/templates/list" => Some(Listing::Templates),
            "prompts/list" => Some(Listing::Prompts),
            _ => None,
        }
    }

    /// The result's member holding the items.
    fn items(self) -> &'static str {
        match self {
            Listing::Tools => "tools",
            Listing::Resources => "resources",
            Listing::Templates => "resourceTemplates",
            Listing::Prompts => "prompts",
        }
    }

    /// The item's member naming it.
    fn key(self) -> &'static str {
        match self {
            Listing::Tools | Listing::Prompts => "name",
            Listing::Resources => "uri",
            Listing::Templates => "uriTemplate",
        }
    }
}

/// What becomes of one listed tool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Edit {
    Keep,
    Annotate(Availability),
    /// Not listed: the caller may not call it (issue 20).
    Hide,
}

/// Reads `message` (one JSON-RPC message) as the answer to the `tools/list` of `id`, and
/// annotates each listed tool `availability` names a reason for.
pub fn annotate_message(
    message: &[u8],
    id: &RawId,
    mut availability: impl FnMut(&str) -> Option<Availability>,
) -> Listed {
    edit_message(Listing::Tools, message, id, |tool| {
        availability(tool).map_or(Edit::Keep, Edit::Annotate)
    })
}

/// Reads `message` as the answer to the listing (`tools/list`, `prompts/list`, ...) of `id`,
/// and edits each listed item as `edit` says (by its name, or its URI). An item without a
/// readable name is kept, unless `edit` hides every item it is asked about unnamed (`""`):
/// a listing filtered for a caller never shows what it could not judge.
pub fn edit_message(
    listing: Listing,
    message: &[u8],
    id: &RawId,
    mut edit: impl FnMut(&str) -> Edit,
) -> Listed {
    if first_non_ws(message) != Some(b'{') {
        return match serde_json::from_slice::<serde::de::IgnoredAny>(message) {
            Ok(_) => Listed::NotTheResponse,
            Err(_) => Listed::Unread,
        };
    }
    let Ok(Members(mut members)) = serde_json::from_slice::<Members<'_>>(message) else {
        return Listed::Unread;
    };
    let (Ok(method), Ok(their_id), Ok(result), Ok(error)) = (
        member(&members, "method"),
        member(&members, "id"),
        member(&members, "result"),
        member(&members, "error"),
    ) else {
        return Listed::Unread;
    };
    // A server-to-client request may reuse the client's id: a `method` says it is not a
    // response.
    if method.is_some() || !their_id.is_some_and(|theirs| id.matches(theirs.get())) {
        return Listed::NotTheResponse;
    }
    if error.is_some() {
        return Listed::Unchanged;
    }
    let Some(result) = result else {
        return Listed::Unread;
    };
    let Ok(Members(mut fields)) = serde_json::from_str::<Members<'_>>(result.get()) else {
        return Listed::Unread;
    };
    let Ok(Some(tools)) = member(&fields, listing.items()) else {
        return Listed::Unread;
    };
    let Ok(mut tools) = serde_json::from_str::<Vec<&RawValue>>(tools.get()) else {
        return Listed::Unread;
    };
    // Built here, borrowed by `tools` below.
    let mut rewritten: Vec<(usize, Box<RawValue>)> = Vec::new();
    let mut hide = Vec::new();
    for (i, tool) in tools.iter().enumerate() {
        // Anything but an object with a string name is not a tool anyone can call: left alone
        // unless unjudged tools are hidden.
        let avail = match name_of(listing, tool) {
            Some(name) => edit(&name),
            None => match edit("") {
                Edit::Hide => Edit::Hide,
                _ => Edit::Keep,
            },
        };
        let avail = match avail {
            Edit::Keep => continue,
            Edit::Hide => {
                hide.push(i);
                continue;
            }
            Edit::Annotate(avail) => avail,
        };
        let Ok(mut definition) = serde_json::from_str::<Map<String, Value>>(tool.get()) else {
            continue;
        };
        annotate(&mut definition, &avail);
        if let Ok(raw) = to_raw_value(&definition) {
            rewritten.push((i, raw));
        }
    }
    if rewritten.is_empty() && hide.is_empty() {
        return Listed::Unchanged;
    }
    for (i, raw) in &rewritten {
        tools[*i] = raw;
    }
    let hidden = hide.len();
    for i in hide.into_iter().rev() {
        tools.remove(i);
    }
    let Ok(tools) = to_raw_value(&tools) else {
        return Listed::Unread;
    };
    set(&mut fields, listing.items(), &tools);
    let Ok(result) = to_raw_value(&Members(fields)) else {
        return Listed::Unread;
    };
    set(&mut members, "result", &result);
    match serde_json::to_vec(&Members(members)) {
        Ok(body) => Listed::Annotated {
            body,
            annotated: rewritten.len(),
            hidden,
        },
        Err(_) => Listed::Unread,
    }
}

/// The member `name`; `Err` when there are two: which one a client reads is anyone's guess.
fn member<'a>(members: &[(Str<'a>, &'a RawValue)], name: &str) -> Result<Option<&'a RawValue>, ()> {
    let mut found = members.iter().filter(|(k, _)| k.0 == name).map(|(_, v)| *v);
    match (found.next(), found.next()) {
        (Some(_), Some(_)) => Err(()),
        (first, _) => Ok(first),
    }
}

fn set<'a>(members: &mut [(Str<'a>, &'a RawValue)], name: &str, value: &'a RawValue) {
    for (k, v) in members.iter_mut() {
        if k.0 == name {
            *v = value;
        }
    }
}

/// An item's name (or URI): a string member, once.
fn name_of<'a>(listing: Listing, item: &'a RawValue) -> Option<std::borrow::Cow<'a, str>> {
    let Members(members) = serde_json::from_str::<Members<'_>>(item.get()).ok()?;
    let raw = member(&members, listing.key()).ok()??;
    serde_json::from_str::<Str<'_>>(raw.get()).ok().map(|s| s.0)
}

/// A JSON object's members in their order, values unread.
struct Members<'a>(Vec<(Str<'a>, &'a RawValue)>);

impl<'de: 'a, 'a> Deserialize<'de> for Members<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut members = Vec::new();
                while let Some(entry) = map.next_entry::<Str<'de>, &'de RawValue>()? {
                    members.push(entry);
                }
                Ok(Members(members))
            }
        }
        d.deserialize_map(V)
    }
}

impl Serialize for Members<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            map.serialize_entry(k.0.as_ref(), v)?;
        }
        map.end()
    }
}

/// What an SSE stream read so far says about the answer to a `tools/list`.
#[derive(Debug, PartialEq, Eq)]
pub enum SseListed {
    /// The response has not come yet: hold what came and read again with more.
    Incomplete,
    /// The stream ended without the response.
    Ended,
    /// The response came, in a complete event; `Annotated` carries the whole stream so far
    /// with that event rewritten (its `data` on one line; every other line and event kept).
    Found(Listed),
}

const BOM: &[u8] = b"\xEF\xBB\xBF";

/// Looks for the response to `id` among the complete events of `stream` (everything the
/// server sent so far; `ended` once it is all), following the WHATWG event-stream rules the
/// filter's [`crate::mcp::sse`] scanner follows: events of a type other than `message` are
/// not delivered to MCP clients, an unterminated last event is dropped at the end.
pub fn annotate_sse(
    stream: &[u8],
    id: &RawId,
    mut availability: impl FnMut(&str) -> Option<Availability>,
    ended: bool,
) -> SseListed {
    edit_sse(
        Listing::Tools,
        stream,
        id,
        |tool| availability(tool).map_or(Edit::Keep, Edit::Annotate),
        ended,
    )
}

/// [`edit_message`] on the response found in an SSE stream (see [`annotate_sse`]).
pub fn edit_sse(
    listing: Listing,
    stream: &[u8],
    id: &RawId,
    mut edit: impl FnMut(&str) -> Edit,
    ended: bool,
) -> SseListed {
    let start = if stream.starts_with(BOM) {
        BOM.len()
    } else {
        0
    };
    let mut event = Event::default();
    let mut at = start;
    while let Some((line_end, next)) = line_at(stream, at) {
        let line = &stream[at..line_end];
        if line.is_empty() {
            // An event with empty data is not dispatched (rmcp primes its streams with one).
            if event.is_message() && !event.data.is_empty() {
                match edit_message(listing, &event.data, id, &mut edit) {
                    Listed::NotTheResponse => {}
                    Listed::Annotated {
                        body,
                        annotated,
                        hidden,
                    } => {
                        let body = event.rewrite(stream, &body);
                        return SseListed::Found(Listed::Annotated {
                            body,
                            annotated,
                            hidden,
                        });
                    }
                    other => return SseListed::Found(other),
                }
            }
            event = Event::default();
        } else {
            event.field(line, at, next);
        }
        at = next;
    }
    if ended {
        SseListed::Ended
    } else {
        SseListed::Incomplete
    }
}

/// The end of the line starting at `at` and the start of the next; `None` while the line's
/// end has not come. A CR at the very end may be the first half of a CRLF: wait for more.
fn line_at(stream: &[u8], at: usize) -> Option<(usize, usize)> {
    let rest = stream.get(at..)?;
    let i = rest.iter().position(|b| matches!(b, b'\r' | b'\n'))?;
    let end = at + i;
    match (stream[end], stream.get(end + 1)) {
        (b'\r', Some(b'\n')) => Some((end, end + 2)),
        (b'\r', None) => None,
        _ => Some((end, end + 1)),
    }
}

/// The event being read.
#[derive(Default)]
struct Event {
    /// Its `data` lines' values joined with LF.
    data: Vec<u8>,
    /// Where each `data` line starts and where the next line starts.
    data_lines: Vec<(usize, usize)>,
    event_type: Vec<u8>,
}

impl Event {
    fn field(&mut self, line: &[u8], at: usize, next: usize) {
        if line.first() == Some(&b':') {
            return;
        }
        let (name, value) = match line.iter().position(|&b| b == b':') {
            Some(i) => {
                let v = &line[i + 1..];
                (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &b""[..]),
        };
        match name {
            b"data" => {
                if !self.data_lines.is_empty() {
                    self.data.push(b'\n');
                }
                self.data.extend_from_slice(value);
                self.data_lines.push((at, next));
            }
            b"event" => self.event_type = value.to_vec(),
            _ => {}
        }
    }

    fn is_message(&self) -> bool {
        self.event_type.is_empty() || self.event_type == b"message"
    }

    /// `stream` with this event's data lines replaced by one carrying `data`, where the first
    /// was (its line end kept).
    fn rewrite(&self, stream: &[u8], data: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(stream.len() + data.len());
        let mut copied = 0;
        for (n, &(start, next)) in self.data_lines.iter().enumerate() {
            out.extend_from_slice(&stream[copied..start]);
            if n == 0 {
                let line_end = stream[start..next]
                    .iter()
                    .position(|b| matches!(b, b'\r' | b'\n'))
                    .map_or(next, |i| start + i);
                out.extend_from_slice(b"data: ");
                out.extend_from_slice(data);
                out.extend_from_slice(&stream[line_end..next]);
            }
            copied = next;
        }
        out.extend_from_slice(&stream[copied..]);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use toolgate_model::availability::{Unavailable, AVAILABILITY_KEY};

    fn id() -> RawId {
        RawId::from_json("7").expect("id")
    }

    fn forced(name: &str) -> Option<Availability> {
        (name == "get_stock").then(|| Availability {
            why: Unavailable::ForcedOpen {
                reason: "maintenance".into(),
            },
            fallback: Some("get_stock_cached".into()),
        })
    }

    const LISTING: &str = r#"{"jsonrpc":"2.0","id":7,"result":{"tools":[{"name":"get_stock","description":"Stock of an item.","inputSchema":{"type":"object"}},{"name": "reserve" , "inputSchema":{"type":"object"}}],"nextCursor":"c2"}}"#;

    fn annotated(body: &[u8]) -> Value {
        serde_json::from_slice(body).expect("json")
    }

    #[test]
    fn an_unavailable_tool_is_annotated_and_the_rest_kept_byte_for_byte() {
        let Listed::Annotated {
            body, annotated: 1, ..
        } = annotate_message(LISTING.as_bytes(), &id(), forced)
        else {
            panic!("annotated")
        };
        let text = String::from_utf8(body.clone()).expect("utf-8");
        // The other tool, spaces and all, and the member order.
        assert!(
            text.contains(r#"{"name": "reserve" , "inputSchema":{"type":"object"}}"#),
            "{text}"
        );
        assert!(text.starts_with(r#"{"jsonrpc":"2.0","id":7,"result":{"tools":["#));
        assert!(text.ends_with(r#"],"nextCursor":"c2"}}"#), "{text}");
        let v = annotated(&body);
        let t = &v["result"]["tools"][0];
        assert_eq!(t["name"], "get_stock");
        assert_eq!(t["_meta"][AVAILABILITY_KEY]["state"], "forced_open");
        assert_eq!(t["_meta"][AVAILABILITY_KEY]["fallback"], "get_stock_cached");
        assert_eq!(
            t["description"],
            "Stock of an item. Unavailable now: an operator took it out of service: \
             maintenance; use get_stock_cached instead."
        );
    }

    #[test]
    fn a_tool_without_description_gets_the_sentence_as_its_description() {
        let body = br#"{"jsonrpc":"2.0","id":7,"result":{"tools":[{"name":"get_stock","inputSchema":{"type":"object"}}]}}"#;
        let Listed::Annotated { body, .. } = annotate_message(body, &id(), forced) else {
            panic!("annotated")
        };
        let v = annotated(&body);
        assert_eq!(
            v["result"]["tools"][0]["description"],
            "Unavailable now: an operator took it out of service: maintenance; use \
             get_stock_cached instead."
        );
    }

    #[test]
    fn nothing_to_annotate_leaves_the_listing_alone() {
        assert_eq!(
            annotate_message(LISTING.as_bytes(), &id(), |_| None),
            Listed::Unchanged
        );
        let error = br#"{"jsonrpc":"2.0","id":7,"error":{"code":-32603,"message":"x"}}"#;
        assert_eq!(annotate_message(error, &id(), forced), Listed::Unchanged);
    }

    #[test]
    fn entries_that_are_not_tools_are_left_where_they_are() {
        let body = br#"{"jsonrpc":"2.0","id":7,"result":{"tools":[3,"get_stock",null,{"name":5},{"description":"no name"},{"name":"get_stock"}]}}"#;
        let Listed::Annotated {
            body, annotated: 1, ..
        } = annotate_message(body, &id(), forced)
        else {
            panic!("annotated")
        };
        let v = annotated(&body);
        let tools = v["result"]["tools"].as_array().expect("tools");
        assert_eq!(tools.len(), 6);
        assert_eq!(
            &tools[..5],
            &[
                json!(3),
                json!("get_stock"),
                json!(null),
                json!({"name": 5}),
                json!({"description": "no name"})
            ]
        );
        assert_eq!(tools[5]["_meta"][AVAILABILITY_KEY]["state"], "forced_open");
    }

    #[test]
    fn what_is_not_a_listing_is_passed_unread() {
        let cases: [(&[u8], Listed); 9] = [
            (b"not json", Listed::Unread),
            (
                b"{\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{\"tools\":[",
                Listed::Unread,
            ),
            (br#"{"jsonrpc":"2.0","id":7,"result":{}}"#, Listed::Unread),
            (
                br#"{"jsonrpc":"2.0","id":7,"result":{"tools":{}}}"#,
                Listed::Unread,
            ),
            (br#"{"jsonrpc":"2.0","id":7,"result":[1]}"#, Listed::Unread),
            (br#"{"jsonrpc":"2.0","id":7}"#, Listed::Unread),
            (
                br#"{"jsonrpc":"2.0","id":7,"id":7,"result":{"tools":[]}}"#,
                Listed::Unread,
            ),
            (
                br#"{"jsonrpc":"2.0","id":8,"result":{"tools":[{"name":"get_stock"}]}}"#,
                Listed::NotTheResponse,
            ),
            (
                br#"{"jsonrpc":"2.0","id":7,"method":"sampling/createMessage","params":{}}"#,
                Listed::NotTheResponse,
            ),
        ];
        for (body, want) in cases {
            assert_eq!(
                annotate_message(body, &id(), forced),
                want,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        assert_eq!(
            annotate_message(b"[1]", &id(), forced),
            Listed::NotTheResponse
        );
    }

    #[test]
    fn an_sse_listing_is_annotated_in_its_event_and_other_events_are_kept() {
        let stream = format!(
            "id: 0\r\nretry: 3000\r\ndata:\r\n\r\n: ping\r\nevent: message\r\ndata: {{\"jsonrpc\":\"2.0\",\"method\":\"notifications/message\",\"params\":{{}}}}\r\n\r\nid: e2\r\ndata: {}\r\n\r\nevent: other\r\ndata: x\r\n\r\n",
            LISTING
        );
        let SseListed::Found(Listed::Annotated {
            body, annotated: 1, ..
        }) = annotate_sse(stream.as_bytes(), &id(), forced, false)
        else {
            panic!("annotated")
        };
        let text = String::from_utf8(body).expect("utf-8");
        let (before, rest) = text.split_once("id: e2\r\ndata: ").expect("event kept");
        assert_eq!(before, stream.split_once("id: e2").expect("split").0);
        let (data, after) = rest.split_once("\r\n\r\n").expect("event end");
        assert_eq!(after, "event: other\r\ndata: x\r\n\r\n");
        let v = annotated(data.as_bytes());
        assert_eq!(
            v["result"]["tools"][0]["_meta"][AVAILABILITY_KEY]["state"],
            "forced_open"
        );
    }

    #[test]
    fn an_sse_response_split_over_data_lines_becomes_one_line() {
        let stream = "data: {\"jsonrpc\":\"2.0\",\"id\":7,\ndata: \"result\":{\"tools\":[{\"name\":\"get_stock\"}]}}\n\n";
        let SseListed::Found(Listed::Annotated { body, .. }) =
            annotate_sse(stream.as_bytes(), &id(), forced, true)
        else {
            panic!("annotated")
        };
        let text = String::from_utf8(body).expect("utf-8");
        assert!(
            text.starts_with("data: {") && text.ends_with("}\n\n"),
            "{text}"
        );
        assert_eq!(text.matches("data:").count(), 1);
    }

    #[test]
    fn an_sse_stream_is_read_again_until_its_response_event_is_complete() {
        let full = format!("data: {LISTING}\n\n");
        for cut in [0, 3, 20, full.len() - 1] {
            assert_eq!(
                annotate_sse(&full.as_bytes()[..cut], &id(), forced, false),
                SseListed::Incomplete,
                "{cut}"
            );
        }
        assert_eq!(
            annotate_sse(&full.as_bytes()[..20], &id(), forced, true),
            SseListed::Ended
        );
        assert_eq!(
            annotate_sse(full.as_bytes(), &id(), |_| None, false),
            SseListed::Found(Listed::Unchanged)
        );
        assert_eq!(
            annotate_sse(b"data: nope\n\n", &id(), forced, false),
            SseListed::Found(Listed::Unread)
        );
    }

    #[test]
    fn a_listing_filtered_for_a_caller_leaves_out_what_it_may_not_call() {
        let body = br#"{"jsonrpc":"2.0","id":7,"result":{"tools":[{"name":"read_order","inputSchema":{}},{"name":"write_order"},{"nameless":1}],"nextCursor":"c"}}"#;
        let hide = |tool: &str| {
            if tool == "read_order" {
                Edit::Keep
            } else {
                Edit::Hide
            }
        };
        let Listed::Annotated {
            body: out,
            annotated: 0,
            hidden: 2,
        } = edit_message(Listing::Tools, body, &id(), hide)
        else {
            panic!("filtered")
        };
        assert_eq!(
            std::str::from_utf8(&out).expect("utf-8"),
            r#"{"jsonrpc":"2.0","id":7,"result":{"tools":[{"name":"read_order","inputSchema":{}}],"nextCursor":"c"}}"#
        );
        // Nothing to hide: the server's bytes.
        assert_eq!(
            edit_message(Listing::Tools, body, &id(), |_| Edit::Keep),
            Listed::Unchanged
        );
    }

    #[test]
    fn resource_template_and_prompt_listings_are_filtered_by_uri_template_and_name() {
        let keep_public = |name: &str| {
            if name.contains("public") {
                Edit::Keep
            } else {
                Edit::Hide
            }
        };
        for (listing, body, kept) in [
            (
                Listing::Resources,
                r#"{"jsonrpc":"2.0","id":7,"result":{"resources":[{"uri":"file:///public/a","name":"a"},{"uri":"file:///secret/b","name":"public-looking"},{"uri":"file:///public/c","uri":"file:///secret/c"}]}}"#,
                "file:///public/a",
            ),
            (
                Listing::Templates,
                r#"{"jsonrpc":"2.0","id":7,"result":{"resourceTemplates":[{"uriTemplate":"file:///secret/{p}","name":"public"},{"uriTemplate":"file:///public/{p}"}]}}"#,
                "file:///public/{p}",
            ),
            (
                Listing::Prompts,
                r#"{"jsonrpc":"2.0","id":7,"result":{"prompts":[{"name":"private"},{"name":"public_prompt"},{"title":"public"}]}}"#,
                "public_prompt",
            ),
        ] {
            let Listed::Annotated { body: out, .. } =
                edit_message(listing, body.as_bytes(), &id(), keep_public)
            else {
                panic!("{listing:?} filtered")
            };
            let v: Value = serde_json::from_slice(&out).expect("json");
            let items = v["result"][listing.items()].as_array().expect("items");
            assert_eq!(items.len(), 1, "{listing:?}: {v}");
            assert_eq!(items[0][listing.key()], kept, "{listing:?}: {v}");
        }
        // A `tools` member in a resources listing is not what is filtered.
        let odd = br#"{"jsonrpc":"2.0","id":7,"result":{"tools":[{"name":"x"}]}}"#;
        assert_eq!(
            edit_message(Listing::Resources, odd, &id(), |_| Edit::Hide),
            Listed::Unread
        );
    }
}
