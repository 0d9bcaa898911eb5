//! Session ids on a service's route: sealed on the way out, opened on the way in, and never
//! taken from a client as an address.

use super::*;

#[test]
fn session_ids_are_sealed_on_the_way_out_and_opened_on_the_way_in() {
    let w = Worker::new();
    let mut config = w.shared.borrow().config.clone();
    config.session_key.0 = "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=".into();
    assert_ne!(w.shared.borrow_mut().configure(config), Sealing::BadKey);
    let envelope = "MTI3LjAuMC4xOjQ0MTE3;8c1f3a";
    let out = Stream::default();
    {
        let mut h = out.request_headers.borrow_mut();
        h.insert(":path".into(), "/mcp/orders".into());
        h.insert(":method".into(), "POST".into());
        out.response_headers
            .borrow_mut()
            .insert(SESSION_HEADER.into(), envelope.into());
    }
    *out.request_body.borrow_mut() =
        br#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{}}"#.to_vec();
    let mut call = Call::new(w.shared.clone());
    call.on_request_headers(&out, false);
    call.on_request_body(&out, 58, true);
    call.on_response_headers(&out, false);
    let sealed = out.response_headers.borrow()[SESSION_HEADER].clone();
    assert!(
        sealed.starts_with("tgs1.") && !sealed.contains("MTI3"),
        "{sealed}"
    );

    let back = Stream::default();
    {
        let mut h = back.request_headers.borrow_mut();
        h.insert(":path".into(), "/mcp/orders".into());
        h.insert(":method".into(), "DELETE".into());
        h.insert(SESSION_HEADER.into(), sealed);
    }
    Call::new(w.shared.clone()).on_request_headers(&back, true);
    assert_eq!(back.request_headers.borrow()[SESSION_HEADER], envelope);

    let forged = Stream::default();
    {
        let mut h = forged.request_headers.borrow_mut();
        h.insert(":path".into(), "/mcp/orders".into());
        h.insert(":method".into(), "GET".into());
        h.insert(SESSION_HEADER.into(), envelope.into());
    }
    Call::new(w.shared.clone()).on_request_headers(&forged, true);
    assert_eq!(
        forged.request_headers.borrow()[SESSION_HEADER],
        format!("!{envelope}"),
        "an address written by the client picks no instance"
    );
}
