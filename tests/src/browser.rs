//! A real browser for the console test: Debian's headless Chromium driven over WebDriver by
//! its chromedriver, both installed by `make setup`, listening on loopback only.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::json;

use crate::paths::free_port;
use crate::process::Proc;
use crate::testenv::TestEnv;

const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

pub struct Browser {
    pub client: Client,
    shots: PathBuf,
    // Dropped after the client: kills chromedriver and the Chromium it started (one group).
    _driver: Proc,
}

impl Browser {
    /// Starts chromedriver and a headless Chromium window of `width`×`height`.
    pub async fn start(env: &TestEnv, width: u32, height: u32) -> Browser {
        for bin in [CHROMIUM, CHROMEDRIVER] {
            assert!(
                Path::new(bin).exists(),
                "{bin} is missing: run `make setup` (it installs chromium and chromium-driver)"
            );
        }
        let port = free_port();
        let driver = env.spawn(
            "chromedriver",
            Path::new(CHROMEDRIVER),
            &[
                format!("--port={port}"),
                "--allowed-ips=127.0.0.1".into(),
                format!(
                    "--log-path={}",
                    env.path("chromedriver.verbose.log").display()
                ),
            ],
        );
        let profile = env.path("chromium-profile");
        let mut caps = fantoccini::wd::Capabilities::new();
        caps.insert(
            "goog:chromeOptions".into(),
            json!({
                "binary": CHROMIUM,
                "args": [
                    "--headless=new",
                    // Tests run as root in CI containers, where the sandbox cannot start.
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-dev-shm-usage",
                    "--no-first-run",
                    "--no-default-browser-check",
                    "--disable-extensions",
                    "--disable-background-networking",
                    "--disable-component-update",
                    format!("--user-data-dir={}", profile.display()),
                    format!("--window-size={width},{height}"),
                ],
            }),
        );
        let url = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(30);
        let client = loop {
            let connector = hyper_util::client::legacy::connect::HttpConnector::new();
            match ClientBuilder::new(connector)
                .capabilities(caps.clone())
                .connect(&url)
                .await
            {
                Ok(client) => break client,
                Err(e) if Instant::now() > deadline => {
                    panic!("no WebDriver session from chromedriver at {url}: {e}")
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        };
        Browser {
            client,
            shots: env.dir().to_path_buf(),
            _driver: driver,
        }
    }

    /// Waits up to `timeout` for an element matching the CSS `selector`.
    pub async fn wait_css(
        &self,
        what: &str,
        selector: &str,
        timeout: Duration,
    ) -> fantoccini::elements::Element {
        match self
            .client
            .wait()
            .at_most(timeout)
            .every(Duration::from_millis(100))
            .for_element(Locator::Css(selector))
            .await
        {
            Ok(e) => e,
            Err(e) => {
                self.screenshot("failed").await;
                let source = self.client.source().await.unwrap_or_default();
                panic!("{what}: no `{selector}` within {timeout:?} ({e}); page:\n{source}")
            }
        }
    }

    /// Clicks the element matching `selector` once it is there. A row can be rebuilt by the
    /// page's refresh between finding and clicking (a stale element): found again then.
    pub async fn click(&self, what: &str, selector: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let e = self.wait_css(what, selector, timeout).await;
            match e.click().await {
                Ok(()) => return,
                Err(err) if Instant::now() > deadline => {
                    panic!("{what}: clicking `{selector}`: {err}")
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    pub async fn css(&self, selector: &str) -> Option<fantoccini::elements::Element> {
        self.client.find(Locator::Css(selector)).await.ok()
    }

    pub async fn count(&self, selector: &str) -> usize {
        self.client
            .find_all(Locator::Css(selector))
            .await
            .map_or(0, |v| v.len())
    }

    /// Saves a PNG of the viewport as `<test dir>/<name>.png` (a test artifact).
    pub async fn screenshot(&self, name: &str) -> PathBuf {
        let path = self.shots.join(format!("{name}.png"));
        match self.client.screenshot().await {
            Ok(png) => {
                if let Err(e) = std::fs::write(&path, png) {
                    eprintln!("writing {}: {e}", path.display());
                }
            }
            Err(e) => eprintln!("screenshot {name}: {e}"),
        }
        path
    }

    pub async fn close(self) {
        let _ = self.client.close().await;
    }
}
