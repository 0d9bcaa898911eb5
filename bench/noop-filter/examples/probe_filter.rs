//! A proxy-wasm filter that repeats the toolgate filter's per-request work up to a level the
//! request names in `x-probe: N` (cumulative), so `make bench` can measure, on one Envoy and in
//! one run, how much each step costs:
//!
//! | level | adds |
//! | --- | --- |
//! | 0 | nothing but reading `x-probe` |
//! | 1 | reading the seven request headers the toolgate filter reads |
//! | 2 | holding the request headers until the body is complete (`Pause`) |
//! | 3 | copying the request body into the VM and parsing its JSON-RPC envelope |
//! | 4 | one shared-data get (a 256-byte value) and the clock, as the breaker's admit does |
//! | 5 | reading the response status, two headers and `response.code_details` |
//! | 6 | holding the response body until complete, copying it and parsing its envelope |
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
                for name in [
                    ":path",
                    ":method",
                    "mcp-protocol-version",
                    "accept",
                    "mcp-method",
                    "mcp-name",
                    "content-length",
                ] {
                    black_box(self.get_http_request_header(name));
                }
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

        fn on_http_response_headers(&mut self, _n: usize, _end_of_stream: bool) -> Action {
            if self.level >= 5 {
                black_box(self.get_http_response_header(":status"));
                black_box(self.get_http_response_header("x-envoy-overloaded"));
                black_box(self.get_property(vec!["response", "code_details"]));
                black_box(self.get_http_response_header("content-type"));
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
