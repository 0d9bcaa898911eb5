//! One HTTP stream: Envoy's callbacks forwarded to [`Call`], and [`CallHost`] as host calls.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action as WasmAction, BufferType, LogLevel, MapType};

use super::events::{enqueue, Queue};
use super::{log, now_ms, HostMetrics, HostShared, HostStore};
use crate::call::{Action, Call, CallHost, Level};
use crate::header_map::HeaderMap;
use crate::mcp::reply::Reply;

/// How long a call waits for toolgate-xds to open (or re-open) a session with a server for its
/// client: toolgate-xds gives each request to the server 10 s.
const SESSION_QUESTION_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(12);

/// The host calls of the stream being served (proxy-wasm addresses the current one), for one
/// callback: each header map is read whole, once, at its first use, and the clock once (issue
/// 21: a host call per header cost a crossing each, two for a header that is present).
#[derive(Default)]
struct Envoy {
    request_headers: RefCell<Option<HeaderMap>>,
    response_headers: RefCell<Option<HeaderMap>>,
    now_ms: Cell<Option<u64>>,
}

// The ABI's own header calls: proxy-wasm's wrappers (`hostcalls::set_map_value`) panic on any
// status but Ok, and Envoy answers BadArgument when the map is no longer there: the request
// headers of a call that was paused for a session question and resumed, set while its
// response is read (the held-response mark), killed the VM (tests/tests/virtual_servers.rs,
// a stateless server answering JSON through `/virtual/<name>` with a gateway session).
#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_replace_header_map_value(
        map_type: MapType,
        key_data: *const u8,
        key_size: usize,
        value_data: *const u8,
        value_size: usize,
    ) -> u32;
    fn proxy_remove_header_map_value(
        map_type: MapType,
        key_data: *const u8,
        key_size: usize,
    ) -> u32;
    fn proxy_get_header_map_pairs(
        map_type: MapType,
        return_map_data: *mut *mut u8,
        return_map_size: *mut usize,
    ) -> u32;
}

/// A whole header map in one host call; a map Envoy no longer has reads as empty.
fn header_map(map: MapType) -> HeaderMap {
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    // SAFETY: on success the host hands over `size` bytes it allocated with this module's
    // allocator (`proxy_on_memory_allocate`), which the Vec then owns.
    let bytes = unsafe {
        if proxy_get_header_map_pairs(map, &mut data, &mut size) != 0 || data.is_null() {
            Vec::new()
        } else {
            Vec::from_raw_parts(data, size, size)
        }
    };
    HeaderMap::parse(bytes)
}

/// The header `name` of a map read at most once per callback.
fn cached_header(cache: &RefCell<Option<HeaderMap>>, map: MapType, name: &str) -> Option<String> {
    let mut cache = cache.borrow_mut();
    cache
        .get_or_insert_with(|| header_map(map))
        .get(name)
        .map(str::to_string)
}

/// Keeps a map read earlier in this callback true to a change made through the host.
fn note_set(cache: &RefCell<Option<HeaderMap>>, name: &str, value: Option<&str>) {
    if let Some(map) = cache.borrow_mut().as_mut() {
        map.set(name, value);
    }
}

/// Sets (or removes) a header if Envoy still has the map; a map that is gone leaves nothing to
/// change.
fn set_header(map: MapType, name: &str, value: Option<&str>) {
    // SAFETY: the pointers and lengths are those of live `&str`s, which the host only reads
    // during the call.
    let status = unsafe {
        match value {
            Some(v) => {
                proxy_replace_header_map_value(map, name.as_ptr(), name.len(), v.as_ptr(), v.len())
            }
            None => proxy_remove_header_map_value(map, name.as_ptr(), name.len()),
        }
    };
    // 0 is the ABI's Ok; read as a number, since a status unknown to the enum would be UB.
    if status != 0 {
        log(
            LogLevel::Debug,
            &format!("toolgate: header {name} not set: the host answered status {status}"),
        );
    }
}

impl CallHost for Envoy {
    fn now_ms(&self) -> u64 {
        match self.now_ms.get() {
            Some(now) => now,
            None => {
                let now = now_ms();
                self.now_ms.set(Some(now));
                now
            }
        }
    }

    fn request_header(&self, name: &str) -> Option<String> {
        cached_header(&self.request_headers, MapType::HttpRequestHeaders, name)
    }

    fn request_header_present(&self, name: &str) -> bool {
        let mut cache = self.request_headers.borrow_mut();
        cache
            .get_or_insert_with(|| header_map(MapType::HttpRequestHeaders))
            .contains(name)
    }

    fn set_request_header(&self, name: &str, value: Option<&str>) {
        set_header(MapType::HttpRequestHeaders, name, value);
        note_set(&self.request_headers, name, value);
    }

    fn request_body(&self, len: usize) -> Option<Vec<u8>> {
        hostcalls::get_buffer(BufferType::HttpRequestBody, 0, len)
            .ok()
            .flatten()
    }

    fn set_request_body(&self, len: usize, body: &[u8]) {
        let _ = hostcalls::set_buffer(BufferType::HttpRequestBody, 0, len, body);
    }

    fn response_header(&self, name: &str) -> Option<String> {
        cached_header(&self.response_headers, MapType::HttpResponseHeaders, name)
    }

    fn set_response_header(&self, name: &str, value: Option<&str>) {
        set_header(MapType::HttpResponseHeaders, name, value);
        note_set(&self.response_headers, name, value);
    }

    fn response_body(&self, len: usize) -> Option<Vec<u8>> {
        hostcalls::get_buffer(BufferType::HttpResponseBody, 0, len)
            .ok()
            .flatten()
    }

    fn set_response_body(&self, len: usize, body: &[u8]) {
        let _ = hostcalls::set_buffer(BufferType::HttpResponseBody, 0, len, body);
    }

    fn send_reply(&self, status: u32, reply: &Reply, headers: &[(&str, &str)]) {
        let mut all = vec![
            ("content-type", reply.content_type),
            ("cache-control", "no-store"),
        ];
        all.extend_from_slice(headers);
        let _ = hostcalls::send_http_response(status, all, Some(&reply.body));
    }

    fn property(&self, path: &[&str]) -> Option<Vec<u8>> {
        hostcalls::get_property(path.to_vec()).ok().flatten()
    }

    fn set_property(&self, name: &str, value: &[u8]) {
        // A failure only leaves the field empty (in the log, or for the local-reply mapping).
        let _ = hostcalls::set_property(vec![name], Some(value));
    }

    fn dispatch(&self, path: &str, body: &[u8], authorization: &str) -> Option<u32> {
        hostcalls::dispatch_http_call(
            crate::feedback::CLUSTER,
            crate::feedback::report_headers(path, authorization),
            Some(body),
            vec![],
            SESSION_QUESTION_TIMEOUT,
        )
        .ok()
    }

    fn resume_request(&self) {
        let _ = hostcalls::resume_http_request();
    }

    fn resume_response(&self) {
        let _ = hostcalls::resume_http_response();
    }

    fn send_raw(&self, status: u32, content_type: &str, body: &[u8], headers: &[(&str, &str)]) {
        let mut all = vec![
            ("content-type", content_type),
            ("cache-control", "no-store"),
        ];
        all.extend_from_slice(headers);
        let _ = hostcalls::send_http_response(status, all, Some(body));
    }

    fn log(&self, level: Level, message: &str) {
        log(
            match level {
                Level::Info => LogLevel::Info,
                Level::Warn => LogLevel::Warn,
            },
            message,
        );
    }
}

fn wasm(action: Action) -> WasmAction {
    match action {
        Action::Continue => WasmAction::Continue,
        Action::Pause => WasmAction::Pause,
    }
}

pub(super) struct Stream {
    call: Call<HostStore, HostMetrics>,
    queue: Rc<RefCell<Queue>>,
}

impl Stream {
    pub(super) fn new(shared: Rc<RefCell<HostShared>>, queue: Rc<RefCell<Queue>>) -> Stream {
        Stream {
            call: Call::new(shared),
            queue,
        }
    }

    /// Hands the call's breaker events to the reporting root context.
    fn report(&mut self) {
        for event in self.call.take_events() {
            enqueue(&self.queue, &event);
        }
    }
}

impl Context for Stream {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        // Envoy calls back with no headers when the call timed out or the connection failed.
        let status = if num_headers == 0 {
            None
        } else {
            hostcalls::get_map_value(MapType::HttpCallResponseHeaders, ":status")
                .ok()
                .flatten()
                .and_then(|s| s.parse::<u16>().ok())
        };
        let body = hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
            .ok()
            .flatten()
            .unwrap_or_default();
        self.call
            .on_dispatch_response(&Envoy::default(), token_id, status, &body);
        self.report();
    }
}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _n: usize, end_of_stream: bool) -> WasmAction {
        wasm(
            self.call
                .on_request_headers(&Envoy::default(), end_of_stream),
        )
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> WasmAction {
        wasm(
            self.call
                .on_request_body(&Envoy::default(), body_size, end_of_stream),
        )
    }

    fn on_http_request_trailers(&mut self, _n: usize) -> WasmAction {
        wasm(self.call.on_request_trailers(&Envoy::default()))
    }

    fn on_http_response_headers(&mut self, _n: usize, end_of_stream: bool) -> WasmAction {
        let action = self
            .call
            .on_response_headers(&Envoy::default(), end_of_stream);
        self.report();
        wasm(action)
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> WasmAction {
        let action = self
            .call
            .on_response_body(&Envoy::default(), body_size, end_of_stream);
        self.report();
        wasm(action)
    }

    fn on_log(&mut self) {
        self.call.on_log(&Envoy::default());
        self.report();
    }
}
