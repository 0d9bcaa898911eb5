//! A proxy-wasm filter that does nothing: every HTTP callback returns `Continue`, no header or
//! body is read. `make bench` loads it in place of the toolgate filter (same ECDS resource, same
//! VM and plugin settings), so the difference between the two is the toolgate filter's own work
//! and the difference to an Envoy without a filter is the price of any wasm filter.
//!
//! Only the wasm32 build has code; natively the crate is empty so `cargo build --workspace`
//! and `cargo test --workspace` need no proxy-wasm.

#[cfg(target_arch = "wasm32")]
mod host {
    use proxy_wasm::traits::{Context, HttpContext, RootContext};
    use proxy_wasm::types::{Action, ContextType, LogLevel};

    proxy_wasm::main! {{
        proxy_wasm::set_log_level(LogLevel::Warn);
        proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Root) });
    }}

    struct Root;

    impl Context for Root {}

    impl RootContext for Root {
        // The plugin configuration toolgate-xds sends is accepted and ignored.
        fn on_configure(&mut self, _size: usize) -> bool {
            true
        }

        fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
            Some(Box::new(Noop))
        }

        fn get_type(&self) -> Option<ContextType> {
            Some(ContextType::HttpContext)
        }
    }

    struct Noop;

    impl Context for Noop {}

    impl HttpContext for Noop {
        fn on_http_request_headers(&mut self, _n: usize, _end_of_stream: bool) -> Action {
            Action::Continue
        }

        fn on_http_request_body(&mut self, _size: usize, _end_of_stream: bool) -> Action {
            Action::Continue
        }

        fn on_http_response_headers(&mut self, _n: usize, _end_of_stream: bool) -> Action {
            Action::Continue
        }

        fn on_http_response_body(&mut self, _size: usize, _end_of_stream: bool) -> Action {
            Action::Continue
        }
    }
}
