//! A service whose servers take each caller's own credential, exchanged by toolgate-xds.

use super::*;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use toolgate_model::auth::{AuthConfig, FilterAuth, PAYLOAD_HEADER};

use crate::call::credential::EXCHANGE_PATH;

fn exchanged_worker() -> Worker {
    let w = Worker::new();
    let config = AuthConfig::parse(
        serde_json::json!({
            "resource": "http://gw",
            "authorization_servers": ["http://idp"],
            "issuers": [{"issuer": "http://idp", "jwks": {"inline": {"keys": [{}]}}}]
        })
        .to_string()
        .as_bytes(),
    )
    .expect("valid");
    {
        let mut s = w.shared.borrow_mut();
        s.config.auth = Some(FilterAuth::new(&config, BTreeMap::new(), BTreeMap::new()));
        s.config.exchanged = BTreeMap::from([("orders".to_string(), "f1".to_string())]);
    }
    w
}

fn alice() -> String {
    URL_SAFE_NO_PAD.encode(
        serde_json::json!({"iss": "http://idp", "aud": "http://gw/mcp/orders", "sub": "alice"})
            .to_string(),
    )
}

/// A token whose payload segment is what Envoy forwarded (`tag` tells tokens apart).
fn jwt(tag: &str) -> String {
    format!("h.{}.{tag}", alice())
}

fn call_as(w: &mut Worker, token: &str) -> Flight {
    let token = jwt(token);
    let bearer = format!("Bearer {token}");
    let payload = alice();
    w.request(
        "orders",
        &[("authorization", &bearer), (PAYLOAD_HEADER, &payload)],
        r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"read_order","arguments":{}}}"#,
    )
}

fn answer(f: &mut Flight, status: u16, body: serde_json::Value) -> Action {
    let token = f.stream.dispatched.borrow().len() as u32;
    f.call
        .on_dispatch_response(&f.stream, token, Some(status), body.to_string().as_bytes())
}

#[test]
fn the_call_waits_for_its_credential_then_goes_with_it_and_the_next_finds_it_cached() {
    let mut w = exchanged_worker();
    let mut f = call_as(&mut w, "alice-token");
    {
        let asked = f.stream.dispatched.borrow();
        assert_eq!(asked.len(), 1);
        assert_eq!(asked[0].0, EXCHANGE_PATH);
        let question: Value = serde_json::from_slice(&asked[0].1).expect("json");
        assert_eq!(question["service"], "orders");
        assert_eq!(question["subject_token"], jwt("alice-token"));
    }
    // Judged, but held until the answer.
    assert_eq!(f.body_action, Some(Action::Pause));
    assert_eq!(f.stream.resumed.get(), 0);
    assert!(f.stream.replies.borrow().is_empty());
    answer(
        &mut f,
        200,
        serde_json::json!({"header": "authorization", "value": "Bearer for-orders", "use_for_ms": 60000}),
    );
    assert_eq!(f.stream.resumed.get(), 1);
    assert_eq!(
        f.stream
            .request_headers
            .borrow()
            .get("authorization")
            .map(String::as_str),
        Some("Bearer for-orders")
    );
    let g = call_as(&mut w, "alice-token");
    assert!(g.went_upstream(), "cached: no question, no pause");
    assert!(g.stream.dispatched.borrow().is_empty());
    assert_eq!(
        g.stream
            .request_headers
            .borrow()
            .get("authorization")
            .map(String::as_str),
        Some("Bearer for-orders")
    );
    // Another token is another caller: asked again.
    let h = call_as(&mut w, "bob-token");
    assert_eq!(h.stream.dispatched.borrow().len(), 1);
    assert!(h
        .stream
        .request_headers
        .borrow()
        .get("authorization")
        .is_none());
}

#[test]
fn an_answer_before_the_body_is_whole_lets_the_call_go_without_waiting() {
    let mut w = exchanged_worker();
    let stream = Stream::default();
    {
        let mut h = stream.request_headers.borrow_mut();
        h.insert(":path".into(), "/mcp/orders".into());
        h.insert(":method".into(), "POST".into());
        h.insert(
            "accept".into(),
            "application/json, text/event-stream".into(),
        );
        h.insert(
            "authorization".into(),
            format!("Bearer {}", jwt("alice-token")),
        );
        h.insert(PAYLOAD_HEADER.into(), alice());
    }
    let body = r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"read_order","arguments":{}}}"#;
    *stream.request_body.borrow_mut() = body.as_bytes().to_vec();
    let mut call = Call::new(w.shared.clone());
    assert_eq!(call.on_request_headers(&stream, false), Action::Pause);
    let answered = call.on_dispatch_response(
        &stream,
        1,
        Some(200),
        br#"{"header": "authorization", "value": "Bearer x", "use_for_ms": 1000}"#,
    );
    assert_eq!(answered, Action::Continue);
    assert_eq!(stream.resumed.get(), 0, "the body is still held");
    assert_eq!(
        call.on_request_body(&stream, body.len(), true),
        Action::Continue
    );
    w.now += 1;
}

#[test]
fn a_refused_exchange_is_an_mcp_result_naming_why_and_nothing_goes_upstream() {
    let mut w = exchanged_worker();
    let mut f = call_as(&mut w, "alice-token");
    answer(
        &mut f,
        502,
        serde_json::json!({"failure": "refused", "error": "invalid_target",
            "why": "the identity provider refused to issue a token for orders: invalid_target"}),
    );
    assert_eq!(f.stream.resumed.get(), 0, "never resumed");
    let (status, reply) = f.reply();
    assert_eq!(status, 200);
    assert_eq!(reply["id"], 7);
    assert_eq!(reply["result"]["isError"], true);
    let text = reply["result"]["content"][0]["text"]
        .as_str()
        .unwrap_or_default();
    assert!(
        text.contains("refused to issue a token for orders: invalid_target"),
        "{text}"
    );
    assert!(text.contains("Do not retry"), "{text}");
    assert_eq!(
        reply["result"]["_meta"]["io.toolgate/breaker"]["state"], "no_credential",
        "{reply}"
    );
}

#[test]
fn no_answer_from_the_control_plane_refuses_the_call_too() {
    let mut w = exchanged_worker();
    let mut f = call_as(&mut w, "alice-token");
    let token = f.stream.dispatched.borrow().len() as u32;
    f.call.on_dispatch_response(&f.stream, token, None, b"");
    let (_, reply) = f.reply();
    let text = reply["result"]["content"][0]["text"]
        .as_str()
        .unwrap_or_default();
    assert!(text.contains("did not answer"), "{text}");
    assert!(text.contains("may succeed"), "{text}");
}

#[test]
fn without_a_verified_token_there_is_nothing_to_exchange_401() {
    let mut w = exchanged_worker();
    let f = w.request(
        "orders",
        &[],
        r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"read_order","arguments":{}}}"#,
    );
    assert!(f.stream.dispatched.borrow().is_empty());
    let (status, _) = f.reply();
    assert_eq!(status, 401);
}

#[test]
fn a_token_other_than_the_verified_one_is_not_exchanged() {
    let mut w = exchanged_worker();
    // Envoy verified alice's token from elsewhere (the query parameter); the header holds
    // another one.
    let other = URL_SAFE_NO_PAD.encode(r#"{"sub":"bob"}"#);
    let f = w.request(
        "orders",
        &[
            ("authorization", &format!("Bearer h.{other}.s")),
            (PAYLOAD_HEADER, &alice()),
        ],
        r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"read_order","arguments":{}}}"#,
    );
    assert!(f.stream.dispatched.borrow().is_empty(), "nothing asked");
    let (status, _) = f.reply();
    assert_eq!(status, 401);
}

#[test]
fn a_service_without_an_exchange_asks_nothing() {
    let mut w = exchanged_worker();
    w.shared.borrow_mut().config.exchanged.clear();
    let f = call_as(&mut w, "alice-token");
    assert!(f.went_upstream());
    assert!(f.stream.dispatched.borrow().is_empty());
}

#[test]
fn a_token_envoy_verified_goes_no_further_when_this_filter_has_no_auth_configuration() {
    // jwt_authn keeps verified tokens for an exchange, and this filter's configuration
    // (with auth) was refused or is not here yet.
    let mut w = Worker::new();
    let payload = alice();
    let f = w.request(
        "orders",
        &[
            ("authorization", "Bearer alice-token"),
            (PAYLOAD_HEADER, &payload),
        ],
        r#"{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"read_order","arguments":{}}}"#,
    );
    assert!(f.went_upstream());
    let headers = f.stream.request_headers.borrow();
    assert!(headers.get("authorization").is_none(), "{headers:?}");
    // (The payload header is the route configuration's to remove.)
    drop(headers);
    // Without a verified token, the client's own Authorization goes on as it always did
    // where the gateway checks no tokens.
    let g = w.request(
        "orders",
        &[("authorization", "Bearer for-the-server")],
        r#"{"jsonrpc":"2.0","id":8,"method":"tools/call","params":{"name":"read_order","arguments":{}}}"#,
    );
    assert_eq!(
        g.stream
            .request_headers
            .borrow()
            .get("authorization")
            .map(String::as_str),
        Some("Bearer for-the-server")
    );
}
