//! HTTP(S) toward identity providers: the JWKS toolgate-xds fetches for Envoy, and the token
//! exchanges (RFC 8693) it makes for the filters (`crate::token_exchange`).
//!
//! Its own client rather than the probes' reqwest one: the probes talk plain HTTP to MCP
//! servers on the pod network, an identity provider is usually `https://` on the internet.
//! TLS is rustls with the `ring` provider (the one the etcd client's tonic already links),
//! checked against the system's CA bundle, the file Envoy used when it fetched the keys
//! itself, so the trust an operator configured on the host does not change.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rustls::pki_types::{pem::PemObject, CertificateDer};

/// Where the CAs an `https://` identity provider's certificate is checked with come from,
/// unless `--idp-ca-file` says otherwise.
pub const SYSTEM_CA_FILE: &str = "/etc/ssl/certs/ca-certificates.crt";
/// A document bigger than this is refused (a JWKS is a few kilobytes).
pub const MAX_BODY_BYTES: usize = 1 << 20;

/// Why a fetch gave nothing, in words for a log line and the admin API.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FetchError {
    #[error("{0}")]
    Url(String),
    #[error("no answer within {0} ms")]
    Timeout(u64),
    #[error("{0}")]
    Transport(String),
    #[error("answered HTTP {0}")]
    Status(u16),
    #[error("answer larger than {MAX_BODY_BYTES} bytes, or cut short: {0}")]
    Body(String),
}

/// A token endpoint's answer, whatever its status: an OAuth error (RFC 6749 §5.2) is a JSON
/// body too, and says why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub status: u16,
    pub body: Bytes,
}

/// One client for every identity provider: connections are kept and reused between fetches.
#[derive(Clone)]
pub struct IdpClient {
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
}

impl std::fmt::Debug for IdpClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdpClient").finish_non_exhaustive()
    }
}

impl IdpClient {
    /// Trusts the CAs of `ca_file` (PEM). A missing or unreadable file leaves no CA: every
    /// `https://` fetch then fails naming the certificate, while `http://` ones work, which
    /// is what Envoy did with the same file.
    pub fn new(ca_file: &Path) -> Result<IdpClient, rustls::Error> {
        let mut roots = rustls::RootCertStore::empty();
        let file = ca_file.display();
        match CertificateDer::pem_file_iter(ca_file) {
            Ok(certs) => {
                let (added, ignored) = roots.add_parsable_certificates(certs.flatten());
                if added == 0 {
                    tracing::warn!(ca_file = %file, ignored, "no usable CA certificate: https identity providers will fail their certificate check");
                } else if ignored > 0 {
                    tracing::debug!(ca_file = %file, added, ignored, "CA certificates skipped");
                }
            }
            Err(e) => {
                tracing::warn!(ca_file = %file, error = %e, "no CA bundle: https identity providers will fail their certificate check");
            }
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .build();
        Ok(IdpClient {
            client: Client::builder(TokioExecutor::new())
                .pool_idle_timeout(Duration::from_secs(60))
                .pool_max_idle_per_host(2)
                .build(connector),
        })
    }

    /// `GET uri`, the answer's body when it is a 200 within `timeout`.
    pub async fn get(&self, uri: &str, timeout: Duration) -> Result<Bytes, FetchError> {
        let request = hyper::Request::get(parse_uri(uri)?)
            .header(hyper::header::ACCEPT, "application/json")
            .header(hyper::header::USER_AGENT, "toolgate-xds")
            .body(Full::new(Bytes::new()))
            .map_err(|e| FetchError::Url(e.to_string()))?;
        Ok(self.send(request, timeout, true).await?.body)
    }

    /// `POST uri` of an `application/x-www-form-urlencoded` body (a token request), with
    /// `authorization` (the client's credentials) if given: the answer whatever its status,
    /// within `timeout`, its body bounded like a fetch's.
    pub async fn post_form(
        &self,
        uri: &str,
        authorization: Option<&str>,
        form: String,
        timeout: Duration,
    ) -> Result<Answer, FetchError> {
        let mut request = hyper::Request::post(parse_uri(uri)?)
            .header(
                hyper::header::CONTENT_TYPE,
                "application/x-www-form-urlencoded",
            )
            .header(hyper::header::ACCEPT, "application/json")
            .header(hyper::header::USER_AGENT, "toolgate-xds");
        if let Some(credentials) = authorization {
            // The error would be the same whatever the value: it never quotes it.
            let mut value = hyper::header::HeaderValue::from_str(credentials).map_err(|_| {
                FetchError::Url("the client credentials are not a header value".to_string())
            })?;
            // Shown as `Sensitive` by any `Debug` of the request (a trace of hyper's, a panic).
            value.set_sensitive(true);
            request = request.header(hyper::header::AUTHORIZATION, value);
        }
        let request = request
            .body(Full::new(Bytes::from(form)))
            .map_err(|e| FetchError::Url(e.to_string()))?;
        self.send(request, timeout, false).await
    }

    /// Sends `request` and reads the whole answer, both within `timeout`; with `only_ok`, an
    /// answer other than 200 is `FetchError::Status` and its body is not read (a fetch has no
    /// use for an error page, however large).
    async fn send(
        &self,
        request: hyper::Request<Full<Bytes>>,
        timeout: Duration,
        only_ok: bool,
    ) -> Result<Answer, FetchError> {
        let fetch = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| FetchError::Transport(describe(&e)))?;
            let status = response.status().as_u16();
            if only_ok && status != hyper::StatusCode::OK.as_u16() {
                return Err(FetchError::Status(status));
            }
            let body = Limited::new(response.into_body(), MAX_BODY_BYTES)
                .collect()
                .await
                .map(|b| b.to_bytes())
                .map_err(|e| FetchError::Body(e.to_string()))?;
            Ok(Answer { status, body })
        };
        tokio::time::timeout(timeout, fetch)
            .await
            .map_err(|_| FetchError::Timeout(timeout.as_millis() as u64))?
    }
}

fn parse_uri(uri: &str) -> Result<hyper::Uri, FetchError> {
    uri.parse()
        .map_err(|e: hyper::http::uri::InvalidUri| FetchError::Url(e.to_string()))
}

/// The error with its causes (`client error (Connect): tcp connect error: Connection
/// refused`): hyper's top-level message alone says little.
fn describe(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const JWKS: &str = r#"{"keys":[{"kty":"EC","kid":"k1"}]}"#;

    /// A server on loopback answering each connection's first request with `status` and
    /// [`JWKS`] (after `delay`), over TLS with `tls` if given. Its URL.
    async fn serve(
        tls: Option<tokio_rustls::TlsAcceptor>,
        status: &'static str,
        delay: Duration,
    ) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let scheme = if tls.is_some() { "https" } else { "http" };
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let tls = tls.clone();
                tokio::spawn(async move {
                    let answer = format!(
                        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\n\
                         content-length: {}\r\nconnection: close\r\n\r\n{JWKS}",
                        JWKS.len()
                    );
                    match tls {
                        Some(tls) => {
                            if let Ok(mut s) = tls.accept(tcp).await {
                                let _ = s.read(&mut [0u8; 4096]).await;
                                tokio::time::sleep(delay).await;
                                let _ = s.write_all(answer.as_bytes()).await;
                                let _ = s.shutdown().await;
                            }
                        }
                        None => {
                            let mut s = tcp;
                            let _ = s.read(&mut [0u8; 4096]).await;
                            tokio::time::sleep(delay).await;
                            let _ = s.write_all(answer.as_bytes()).await;
                        }
                    }
                });
            }
        });
        format!("{scheme}://127.0.0.1:{port}/jwks.json")
    }

    /// A certificate for 127.0.0.1, its PEM written to a file, and an acceptor serving it.
    fn certificate(dir: &Path) -> (std::path::PathBuf, tokio_rustls::TlsAcceptor) {
        let made = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_string()]).unwrap();
        let pem = dir.join("idp-ca.pem");
        std::fs::write(&pem, made.cert.pem()).unwrap();
        let key = rustls::pki_types::PrivateKeyDer::Pkcs8(made.signing_key.serialize_der().into());
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![made.cert.der().clone()], key)
        .unwrap();
        (pem, tokio_rustls::TlsAcceptor::from(Arc::new(config)))
    }

    fn temp_dir(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("toolgate-idp-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[tokio::test]
    async fn an_https_provider_is_trusted_only_through_its_ca() {
        let dir = temp_dir("tls");
        let (ca, acceptor) = certificate(&dir);
        let url = serve(Some(acceptor), "200 OK", Duration::ZERO).await;
        let second = Duration::from_secs(5);

        let trusting = IdpClient::new(&ca).unwrap();
        let body = trusting.get(&url, second).await.expect("fetched over TLS");
        assert_eq!(&body[..], JWKS.as_bytes());

        // The system's CAs do not know the test CA; no bundle at all trusts nothing.
        for ca in [Path::new(SYSTEM_CA_FILE), &dir.join("absent.pem")] {
            let e = IdpClient::new(ca)
                .unwrap()
                .get(&url, second)
                .await
                .unwrap_err();
            assert!(
                matches!(&e, FetchError::Transport(t) if t.contains("certificate")),
                "{ca:?}: {e}"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_fetch_fails_by_name() {
        let client = IdpClient::new(Path::new("/nonexistent-ca.pem")).unwrap();
        let url = serve(None, "200 OK", Duration::ZERO).await;
        let body = client.get(&url, Duration::from_secs(5)).await.unwrap();
        assert_eq!(&body[..], JWKS.as_bytes());
        let url = serve(None, "404 Not Found", Duration::ZERO).await;
        assert_eq!(
            client.get(&url, Duration::from_secs(5)).await,
            Err(FetchError::Status(404))
        );
        let url = serve(None, "200 OK", Duration::from_secs(5)).await;
        assert_eq!(
            client.get(&url, Duration::from_millis(200)).await,
            Err(FetchError::Timeout(200))
        );
        assert!(matches!(
            client.get("not a url", Duration::from_secs(1)).await,
            Err(FetchError::Url(_))
        ));
    }
}
