//! HTTP/2 as a hostile client speaks it, below what an HTTP library lets a caller do: request
//! trailers, resets of a stream in flight, and frames after the end of a stream.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// What came back on one stream.
#[derive(Debug)]
pub struct H2Reply {
    pub status: u16,
    pub body: String,
}

fn request(port: u16, path: &str, headers: &[(&str, &str)]) -> Request<()> {
    let mut builder = Request::builder()
        .method("POST")
        .uri(format!("http://127.0.0.1:{port}{path}"))
        .header("content-type", "application/json")
        .header("accept", "application/json, text/event-stream")
        .header("mcp-protocol-version", "2025-06-18");
    for (k, v) in headers {
        builder = builder.header(*k, *v);
    }
    builder.body(()).expect("a request")
}

async fn connect(port: u16) -> h2::client::SendRequest<Bytes> {
    let tcp = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect to envoy");
    let (client, connection) = h2::client::handshake(tcp).await.expect("h2 handshake");
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client.ready().await.expect("h2 ready")
}

/// HEADERS, DATA (`body`, without END_STREAM), then a trailers frame that ends the stream.
pub async fn post_with_trailers(port: u16, path: &str, body: &[u8]) -> H2Reply {
    let mut client = connect(port).await;
    let (response, mut stream) = client
        .send_request(request(port, path, &[]), false)
        .expect("send headers");
    stream
        .send_data(Bytes::copy_from_slice(body), false)
        .expect("send data");
    let mut trailers = HeaderMap::new();
    trailers.insert("x-checksum", HeaderValue::from_static("none"));
    stream.send_trailers(trailers).expect("send trailers");
    read(response).await
}

async fn read(response: h2::client::ResponseFuture) -> H2Reply {
    let response = tokio::time::timeout(Duration::from_secs(15), response)
        .await
        .expect("a response within 15 s")
        .expect("a response");
    let status = response.status().as_u16();
    let mut body = response.into_body();
    let mut out = Vec::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.expect("body data");
        let _ = body.flow_control().release_capacity(chunk.len());
        out.extend_from_slice(&chunk);
    }
    H2Reply {
        status,
        body: String::from_utf8_lossy(&out).into_owned(),
    }
}

/// How a client ends a stream it no longer wants.
#[derive(Debug, Clone, Copy)]
pub enum Abandon {
    /// RST_STREAM with CANCEL.
    Cancel,
    /// RST_STREAM with PROTOCOL_ERROR.
    ProtocolError,
    /// A DATA frame after the stream's END_STREAM (a protocol violation Envoy resets for).
    DataAfterEnd,
}

/// Sends a whole request, waits `after`, then abandons the stream as `how` says, without
/// reading any response.
pub async fn post_and_abandon(
    port: u16,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    after: Duration,
    how: Abandon,
) {
    match how {
        Abandon::Cancel | Abandon::ProtocolError => {
            let mut client = connect(port).await;
            let (_response, mut stream) = client
                .send_request(request(port, path, headers), false)
                .expect("send headers");
            stream
                .send_data(Bytes::copy_from_slice(body), true)
                .expect("send data");
            tokio::time::sleep(after).await;
            stream.send_reset(match how {
                Abandon::Cancel => h2::Reason::CANCEL,
                _ => h2::Reason::PROTOCOL_ERROR,
            });
            // Give the frame time to leave before the connection is dropped.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Abandon::DataAfterEnd => raw_data_after_end(port, path, headers, body, after).await,
    }
}

/// The h2 crate refuses to send DATA after END_STREAM, so this one writes the frames itself.
async fn raw_data_after_end(
    port: u16,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    after: Duration,
) {
    let mut tcp = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect to envoy");
    let authority = format!("127.0.0.1:{port}");
    let mut block = Vec::new();
    for (name, value) in [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", authority.as_str()),
        ("content-type", "application/json"),
        ("accept", "application/json, text/event-stream"),
        ("mcp-protocol-version", "2025-06-18"),
    ]
    .into_iter()
    .chain(headers.iter().copied())
    {
        // HPACK "literal header field without indexing, new name".
        block.push(0x00);
        hpack_string(&mut block, name.as_bytes());
        hpack_string(&mut block, value.as_bytes());
    }
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    frame(&mut out, 0x4, 0, 0, &[]); // SETTINGS
    frame(&mut out, 0x1, 0x4, 1, &block); // HEADERS, END_HEADERS
    frame(&mut out, 0x0, 0x1, 1, body); // DATA, END_STREAM
    tcp.write_all(&out).await.expect("write frames");
    // Acknowledge the server's SETTINGS so that it keeps the connection.
    let mut ack = Vec::new();
    frame(&mut ack, 0x4, 0x1, 0, &[]);
    tcp.write_all(&ack).await.expect("write settings ack");
    tokio::time::sleep(after).await;
    let mut violation = Vec::new();
    frame(&mut violation, 0x0, 0x0, 1, b"more"); // DATA after END_STREAM
    let _ = tcp.write_all(&violation).await;
    let mut sink = [0u8; 4096];
    let _ = tokio::time::timeout(Duration::from_millis(300), tcp.read(&mut sink)).await;
}

fn hpack_string(out: &mut Vec<u8>, s: &[u8]) {
    // 7-bit prefix integer, no Huffman coding.
    let mut len = s.len();
    if len < 127 {
        out.push(len as u8);
    } else {
        out.push(127);
        len -= 127;
        while len >= 128 {
            out.push((len % 128) as u8 | 0x80);
            len /= 128;
        }
        out.push(len as u8);
    }
    out.extend_from_slice(s);
}

fn frame(out: &mut Vec<u8>, kind: u8, flags: u8, stream: u32, payload: &[u8]) {
    let len = payload.len() as u32;
    out.extend_from_slice(&len.to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&stream.to_be_bytes());
    out.extend_from_slice(payload);
}
