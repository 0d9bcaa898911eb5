//! Suite 1, propagation: etcd write -> Envoy applied, seen by a request reaching the new
//! instance (and no longer reaching a removed one), with many instances registered. etcd's own
//! put -> watch-event latency is measured in the same run as the floor.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use etcd_client::{Client, EventType, PutOptions, WatchOptions};
use futures::StreamExt;
use serde::Serialize;
use toolgate_tests::{Envoy, Etcd, McpServer, TestEnv, Xds};

use crate::stats::{summarize, Summary};

#[derive(Debug, Serialize)]
pub struct Propagation {
    pub instances: usize,
    pub etcd_floor: Summary,
    pub add: Summary,
    pub remove: Summary,
    /// A service never seen before, one instance: etcd put -> Envoy routes a request to it
    /// through the filter (its cluster, its assignment and the route table's change applied).
    pub new_service: Summary,
    /// 45 registrations at once (the 5 -> 50 scale-out) until Envoy has all of them.
    pub burst_45_ms: f64,
    /// The same burst until etcd had delivered all 45 events to a watcher of its own: the
    /// part of the burst that is etcd committing 45 concurrent writes on this machine.
    pub burst_45_etcd_ms: f64,
}

const PROBES: usize = 10;
/// New services measured one at a time.
const NEW_SERVICES: usize = 20;
/// Before each new service: services do not arrive 40 ms apart, and a sample taken while
/// Envoy still applies the previous service's filter configuration (9-17 ms of its main
/// thread) measures that one's cost, not its own.
const NEW_SERVICE_SETTLE: Duration = Duration::from_millis(150);
/// Instances of the burst, registered at once (the 5 -> 50 scale-out).
const BURST: usize = 45;
/// Longer than the suite runs at any size it is used at; revoked at its end.
const OWN_LEASE_TTL_SECS: i64 = 600;

pub async fn run(env: &TestEnv, instances: usize, changes: usize) -> anyhow::Result<Propagation> {
    let etcd = Etcd::start(env).await;
    // Probes off: the bulk and the burst are fake endpoints nobody serves, which probes
    // would (rightly) never route. This measures etcd -> registry -> Envoy; with probes on,
    // a new instance is routed one probe round trip later (the health tests measure it).
    let xds = Xds::start(env, "xds", &etcd.endpoint(), &["--no-probes"]).await;
    // The gateway as it is deployed, with the toolgate filter: a new service changes the
    // filter's configuration too (its catalog), which Envoy applies on the same main thread
    // as the clusters and routes.
    let envoy = Envoy::start_with_filter(env, "envoy", &xds, 1, &[]).await;
    let lab = McpServer::lab(env, "probe-target", &["--stateless", "--json-response"]).await;
    let mut client = etcd.client().await;

    // One lease holds every registration of this process; kept alive in the background.
    let lease = client.lease_grant(120, None).await?.id();
    let (mut keeper, mut kstream) = client.lease_keep_alive(lease).await?;
    let keepalive = tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(20)).await;
            if keeper.keep_alive().await.is_err() || kstream.message().await.is_err() {
                return;
            }
        }
    });
    let put_opts = PutOptions::new().with_lease(lease);
    // Every measured instance holds a lease of its own, as a real one does: etcd's put slows
    // with the keys already on the lease it attaches to, and on the bulk's lease (10,000 keys)
    // a put took about 4 ms against 1 ms for a delete, which the add figure counted as
    // propagation. Granted before the clock starts, as a server grants before it registers.
    let own_leases = own_leases(&mut client, PROBES + NEW_SERVICES + BURST).await?;
    let own_lease = |i: usize| PutOptions::new().with_lease(own_leases[i]);

    // The bulk: fake endpoints in services of 10 (nothing connects to them).
    let started = Instant::now();
    futures::stream::iter(0..instances)
        .map(|i| {
            let mut c = client.clone();
            let opts = put_opts.clone();
            async move {
                let key = format!("/mcp/services/svc-{}/i-{i}", i / 10);
                let value = format!(
                    r#"{{"instance_id":"i-{i}","endpoint":"127.0.{}.{}:{}","tools":["t"]}}"#,
                    1 + i / 250 % 250,
                    1 + i % 250,
                    10000 + i % 50000
                );
                c.put(key, value, Some(opts)).await
            }
        })
        .buffer_unordered(64)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    eprintln!(
        "  registered {instances} instances in {:.1} s",
        started.elapsed().as_secs_f64()
    );

    // Probe services: an instance pointing at the real lab, its MCP path set to /health, so a
    // GET through Envoy answers 200 exactly when Envoy routes to it and 503 when it has none.
    let probe_value = |k: usize| {
        format!(
            r#"{{"instance_id":"p","endpoint":"{}","mcp_path":"/health","tools":["t"]}}"#,
            lab.endpoint()
        )
        .replace("\"p\"", &format!("\"p{k}\""))
    };
    for k in 0..PROBES {
        client
            .put(
                format!("/mcp/services/probe-{k}/p{k}"),
                probe_value(k),
                Some(own_lease(k)),
            )
            .await?;
    }
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .no_proxy()
        .pool_max_idle_per_host(4)
        .build()?;
    for k in 0..PROBES {
        wait_status(
            &http,
            &envoy.url(&format!("probe-{k}")),
            200,
            Duration::from_secs(60),
        )
        .await
        .context("initial registration of the probe services")?;
    }
    wait_hosts(&xds, instances + PROBES, Duration::from_secs(60)).await?;
    eprintln!("  Envoy has all {} instances", instances + PROBES);

    let etcd_floor = etcd_floor(&mut client, changes).await?;

    // Single changes, alternating: remove the probe instance, add it back.
    let mut add = Vec::new();
    let mut remove = Vec::new();
    let mut removed = [false; PROBES];
    for i in 0..changes {
        let k = i % PROBES;
        let key = format!("/mcp/services/probe-{k}/p{k}");
        let url = envoy.url(&format!("probe-{k}"));
        let removing = (i / PROBES).is_multiple_of(2);
        let t0 = Instant::now();
        if removing {
            client.delete(key, None).await?;
            wait_status(&http, &url, 503, Duration::from_secs(10)).await?;
            remove.push(t0.elapsed());
            removed[k] = true;
        } else {
            client.put(key, probe_value(k), Some(own_lease(k))).await?;
            wait_status(&http, &url, 200, Duration::from_secs(10)).await?;
            add.push(t0.elapsed());
            removed[k] = false;
        }
    }
    // A change count that ends in a removal block (e.g. 50 = 5 blocks of 10) leaves probes
    // out: put them back (unmeasured) so the burst below starts from every instance.
    for k in (0..PROBES).filter(|&k| removed[k]) {
        client
            .put(
                format!("/mcp/services/probe-{k}/p{k}"),
                probe_value(k),
                Some(own_lease(k)),
            )
            .await?;
        wait_status(
            &http,
            &envoy.url(&format!("probe-{k}")),
            200,
            Duration::from_secs(10),
        )
        .await?;
    }

    // New services, one instance each, under names never registered before: a request
    // through Envoy is routed (200) once its cluster, assignment and route are applied.
    let mut new_service = Vec::with_capacity(NEW_SERVICES);
    for k in 0..NEW_SERVICES {
        let value = probe_value(k).replace(&format!("\"p{k}\""), &format!("\"n{k}\""));
        tokio::time::sleep(NEW_SERVICE_SETTLE).await;
        let t0 = Instant::now();
        client
            .put(
                format!("/mcp/services/new-{k}/n{k}"),
                value,
                Some(own_lease(PROBES + k)),
            )
            .await?;
        wait_status(
            &http,
            &envoy.url(&format!("new-{k}")),
            200,
            Duration::from_secs(10),
        )
        .await
        .with_context(|| format!("new service new-{k}"))?;
        new_service.push(t0.elapsed());
    }

    // Burst: 45 instances of a fresh service registered together, until all 45 take traffic
    // (the lab answers for all of them: same endpoint is fine for routing, but Envoy counts
    // hosts by address, so give each its own loopback address and check the host count).
    // A watcher of the bench's own times etcd's part.
    let mut burst_watch = client
        .watch(
            "/mcp/services/burst/",
            Some(WatchOptions::new().with_prefix()),
        )
        .await?;
    // The creation response.
    burst_watch.message().await?;
    let t0 = Instant::now();
    let etcd_delivered = tokio::spawn(async move {
        let mut seen = 0;
        while seen < BURST {
            match burst_watch.message().await {
                Ok(Some(resp)) => {
                    seen += resp
                        .events()
                        .iter()
                        .filter(|e| e.event_type() == EventType::Put)
                        .count()
                }
                _ => return None,
            }
        }
        Some(t0.elapsed())
    });
    futures::stream::iter(0..BURST)
        .map(|j| {
            let mut c = client.clone();
            let opts = own_lease(PROBES + NEW_SERVICES + j);
            async move {
                let value = format!(
                    r#"{{"instance_id":"b{j}","endpoint":"127.0.255.{}:9","tools":["t"]}}"#,
                    j + 1
                );
                c.put(format!("/mcp/services/burst/b{j}"), value, Some(opts))
                    .await
            }
        })
        .buffer_unordered(BURST)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    // Envoy's membership gauge of the new cluster, polled every 2 ms: the full host list
    // (tens of MB at 10,000 instances) would cost more than what it measures, and it runs on
    // the Envoy main thread that applies the very update being waited for.
    let admin = envoy.admin();
    while admin.stat("cluster.mcp.burst.membership_total").await != BURST as u64 {
        if t0.elapsed() > Duration::from_secs(30) {
            bail!("Envoy did not get the {BURST} burst instances");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let burst_45_ms = t0.elapsed().as_secs_f64() * 1e3;
    let burst_45_etcd_ms = tokio::time::timeout(Duration::from_secs(10), etcd_delivered)
        .await
        .ok()
        .and_then(|joined| joined.ok().flatten())
        .context("the bench's watcher never saw the 45 burst registrations")?
        .as_secs_f64()
        * 1e3;

    keepalive.abort();
    for id in std::iter::once(lease).chain(own_leases.iter().copied()) {
        let _ = client.lease_revoke(id).await;
    }
    Ok(Propagation {
        instances,
        etcd_floor,
        add: summarize(&add),
        remove: summarize(&remove),
        new_service: summarize(&new_service),
        burst_45_ms,
        burst_45_etcd_ms,
    })
}

/// etcd's own put -> watch event latency on this machine, now.
async fn etcd_floor(client: &mut Client, n: usize) -> anyhow::Result<Summary> {
    let mut watch = client
        .watch("/bench/floor/", Some(WatchOptions::new().with_prefix()))
        .await?;
    // The creation response.
    watch.message().await?;
    let mut samples = Vec::with_capacity(n);
    for i in 0..n {
        let t0 = Instant::now();
        client.put(format!("/bench/floor/{i}"), "x", None).await?;
        loop {
            let resp = watch.message().await?.context("floor watch ended")?;
            if resp
                .events()
                .iter()
                .any(|e| e.event_type() == EventType::Put)
            {
                break;
            }
        }
        samples.push(t0.elapsed());
    }
    Ok(summarize(&samples))
}

/// `n` leases that outlive the suite: its measured instances hold one each.
async fn own_leases(client: &mut Client, n: usize) -> anyhow::Result<Vec<i64>> {
    let mut ids = Vec::with_capacity(n);
    for _ in 0..n {
        ids.push(client.lease_grant(OWN_LEASE_TTL_SECS, None).await?.id());
    }
    Ok(ids)
}

/// Polls `url` through Envoy until it answers `status`.
pub(crate) async fn wait_status(
    http: &reqwest::Client,
    url: &str,
    status: u16,
    timeout: Duration,
) -> anyhow::Result<()> {
    let t0 = Instant::now();
    loop {
        if let Ok(r) = http.get(url).send().await {
            if r.status().as_u16() == status {
                return Ok(());
            }
        }
        if t0.elapsed() > timeout {
            bail!("{url} did not answer {status} within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
}

/// Until toolgate-xds has published `n` instances. Read from the gauge the publisher sets, not
/// from `/v1/registry`: at 100,000 instances that is 30 MB of JSON per poll, whose making
/// would be measured as toolgate-xds's own memory and time.
pub(crate) async fn wait_hosts(xds: &Xds, n: usize, timeout: Duration) -> anyhow::Result<()> {
    let t0 = Instant::now();
    while xds.metric("toolgate_registry_instances", "").await < n as f64 {
        if t0.elapsed() > timeout {
            bail!("toolgate-xds did not reach {n} instances");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}
