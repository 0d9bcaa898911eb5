//! A proxy-wasm filter that repeats the toolgate filter's per-request work up to a level the
//! request names in `x-probe: N` (cumulative), so `make bench` can measure, on one Envoy and in
//! one run, how much each step costs:
//!
//! | level | adds |
//! | --- | --- |
//! | 0 | nothing but reading `x-probe` |
//! | 1 | reading the request header map, whole, in one host call (as the toolgate filter does) |
//! | 2 | holding the request headers until the body is complete (`Pause`) |
//! | 3 | copying the request body into the VM, scanning its nesting depth, parsing its envelope |
//! | 4 | one shared-data get (a 256-byte value) and the clock, as the breaker's admit does |
//! | 5 | reading the response header map in one host call, and `upstream.address` (call feedback) |
//! | 6 | holding the response body until complete, copying it and parsing its envelope, the clock |
//! | 7 | holding the response headers too |
//! | 8 | the request marked with the reply for a cut-off answer (a 400-byte request header set while the answer is read) |
//! | 9 | one request header set while the request headers are read (the shared routes' cluster) |
//!
//! What the toolgate filter costs beyond level 9 is its own bookkeeping in the VM: the
//! breaker's window, stats and call-feedback counts, the per-call state.
//!
//! Only the wasm32 build has code.

#[cfg(target_arch = "wasm32")]
mod host {
    use std::hint::black_box;

    use proxy_wasm::traits::{Context, HttpContext, RootContext};
    use proxy_wasm::types::{Action, ContextType, LogLevel};
    use serde::de::IgnoredAny;
    use serde::Deserialize;
    use serde_json::value::RawValue;

    const SHARED_KEY: &str = "toolgate-probe/svc/tool";

    /// The deepest nesting of arrays and objects outside strings, as the toolgate filter's
    /// scan reads it.
    fn depth(body: &[u8]) -> u32 {
        let (mut depth, mut deepest, mut i) = (0u32, 0u32, 0usize);
        while let Some(&b) = body.get(i) {
            i += 1;
            match b {
                b'"' => loop {
                    let Some(at) = body
                        .get(i..)
                        .and_then(|r| r.iter().position(|&c| c == b'"' || c == b'\\'))
                    else {
                        return deepest;
                    };
                    i += at;
                    if body[i] == b'"' {
                        i += 1;
                        break;
                    }
                    i += 2;
                },
                b'{' | b'[' => {
                    depth += 1;
                    deepest = deepest.max(depth);
                }
                b'}' | b']' => depth = depth.saturating_sub(1),
                _ => {}
            }
        }
        deepest
    }

    proxy_wasm::main! {{
        proxy_wasm::set_log_level(LogLevel::Warn);
        proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root) });
    }}

    struct Root;

    impl Context for Root {}

    impl RootContext for Root {
        fn on_configure(&mut self, _size: usize) -> bool {
            let _ = self.set_shared_data(SHARED_KEY, Some(&[7u8; 256]), None);
            true
        }

        fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
            Some(Box::new(Probe { level: 0 }))
        }

        fn get_type(&self) -> Option<ContextType> {
            Some(ContextType::HttpContext)
        }
    }

    #[derive(Deserialize)]
    struct Request<'a> {
        #[serde(borrow, default)]
        method: Option<&'a str>,
        #[serde(borrow, default)]
        id: Option<&'a RawValue>,
        #[serde(borrow, default)]
        params: Option<Params<'a>>,
    }

    #[derive(Deserialize)]
    struct Params<'a> {
        #[serde(borrow, default)]
        name: Option<&'a str>,
    }

    #[derive(Deserialize)]
    struct Response<'a> {
        #[serde(borrow, default)]
        id: Option<&'a RawValue>,
        #[serde(default)]
        method: Option<IgnoredAny>,
        #[serde(default)]
        error: Option<IgnoredAny>,
        #[serde(default)]
        result: Option<ResultFields>,
    }

    #[derive(Deserialize)]
    struct ResultFields {
        #[serde(default, rename = "isError")]
        is_error: bool,
    }

    struct Probe {
        level: u8,
    }

    impl Context for Probe {}

    impl HttpContext for Probe {
        fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
            self.level = self
                .get_http_request_header("x-probe")
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0);
            if self.level >= 1 {
                black_box(self.get_http_request_headers_bytes());
            }
            if self.level >= 9 {
                self.set_http_request_header("x-probe-cluster", Some("mcp.bench-json"));
            }
            if self.level >= 2 && !end_of_stream {
                return Action::Pause;
            }
            Action::Continue
        }

        fn on_http_request_body(&mut self, size: usize, end_of_stream: bool) -> Action {
            if self.level < 2 {
                return Action::Continue;
            }
            if !end_of_stream {
                return Action::Pause;
            }
            if self.level >= 3 {
                let body = self.get_http_request_body(0, size).unwrap_or_default();
                black_box(depth(&body));
                if let Ok(r) = serde_json::from_slice::<Request<'_>>(&body) {
                    black_box((r.method, r.id.map(RawValue::get), r.params.map(|p| p.name)));
                }
            }
            if self.level >= 4 {
                black_box(self.get_shared_data(SHARED_KEY));
                black_box(self.get_current_time());
            }
            Action::Continue
        }

        fn on_http_response_headers(&mut self, _n: usize, end_of_stream: bool) -> Action {
            if self.level >= 5 {
                black_box(self.get_http_response_headers_bytes());
                black_box(self.get_property(vec!["upstream", "address"]));
            }
            if self.level >= 7 && !end_of_stream {
                if self.level >= 8 {
                    let reply = "x".repeat(400);
                    self.set_http_request_header("x-probe-held", Some(&reply));
                }
                return Action::Pause;
            }
            Action::Continue
        }

        fn on_http_response_body(&mut self, size: usize, end_of_stream: bool) -> Action {
            if self.level < 6 {
                return Action::Continue;
            }
            if !end_of_stream {
                return Action::Pause;
            }
            let body = self.get_http_response_body(0, size).unwrap_or_default();
            if let Ok(r) = serde_json::from_slice::<Response<'_>>(&body) {
                black_box((
                    r.id.map(RawValue::get),
                    r.method.is_some(),
                    r.error.is_some(),
                    r.result.map(|x| x.is_error),
                ));
            }
            black_box(self.get_current_time());
            Action::Continue
        }
    }
}
