//! The tool catalog: each service's full tool definitions (description, inputSchema,
//! outputSchema, annotations), read over MCP from one UP instance when the service first has
//! one and again whenever its registered tool list changes, never per client request.
//!
//! The registrar re-registers on the server's `notifications/tools/list_changed`, so a
//! changed list arrives here as a changed registration. The builder reconciles against the
//! in-memory registry each time the registry publishes a new state (a registration, a health
//! transition: a new service's definitions are read as soon as it has an UP instance), and
//! once a second for the retries (etcd is not read); it talks to instances only when probes
//! are on, as `--no-probes` promises that toolgate-xds contacts no instance.
//!
//! A service keeps its entry while it has no instance that takes calls, also after its last
//! registration left: its definitions are the last read, and its state says `no_instance`.
//! The entry lives as long as the registry knows the service (which keeps its cluster, its
//! route and its tool names on the virtual servers until toolgate-xds restarts: a restarted
//! one knows only what etcd has), so `/mcp` never lists a tool it once read without its
//! definition. Each entry is bounded by the read: at most 2,000 tools (`ListLimits`).

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock, RwLockReadGuard};
use std::time::{Duration, Instant, SystemTime};

use serde::Serialize;
use serde_json::Value;
use tokio::sync::watch;
use toolgate_probe::mcp::tools::ListLimits;
use toolgate_probe::mcp::{ExtraHeader, McpClient, STATELESS_REVISION};
use tracing::{info, warn};

use crate::health::machine::State;
use crate::registry::publish::Publisher;
use crate::registry::Registry;
use crate::routing::RoutingSnapshot;
use crate::upstream_credentials::Credentials;

/// The name the catalog builder gives itself in `clientInfo`.
const CLIENT_NAME: &str = "toolgate-catalog";
/// A service whose read failed is tried again after this long, doubled after each further
/// failure up to [`RETRY_MAX`]: a server that does not speak MCP costs little and logs once.
const RETRY_AFTER: Duration = Duration::from_secs(10);
const RETRY_MAX: Duration = Duration::from_secs(300);
/// Services read per pass, so one pass stays short when thousands appear at once.
const READS_PER_PASS: usize = 16;

/// One service's entry.
#[derive(Debug, Clone, Serialize)]
pub struct ServiceCatalog {
    /// The registered tool list the definitions were read for (the newest registration's).
    pub registered: Vec<String>,
    /// The definitions of the registered tools the server listed, in the server's order.
    pub tools: Vec<Value>,
    /// What the server offers besides tools, read with them (see [`Surface`]).
    #[serde(flatten)]
    pub surface: Surface,
    /// The instance read, and the revision it spoke.
    pub from_instance: String,
    pub protocol_version: String,
    /// When it was read (RFC 3339); empty until a read succeeded.
    pub read_at: String,
    /// Why the last read failed, if it did (the definitions of an earlier read stay).
    pub error: Option<String>,
    /// Instances that disagree on their tools, tools registered but not served.
    pub warnings: Vec<String>,
    /// Reads failed in a row.
    pub failures: u32,
    /// Whether the service can take calls now.
    pub state: ServiceState,
    /// The service's registrations now (0: every instance left; the entry stays).
    pub instances: usize,
    /// Since when no instance takes calls (RFC 3339); null while serving.
    pub no_instance_since: Option<String>,
    #[serde(skip)]
    tried: Option<Instant>,
}

/// A service's state in the catalog, as `/mcp` annotates its tools.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ServiceState {
    /// An instance takes calls (UP, or UNHEALTHY at a reduced weight: Envoy still routes to it).
    Serving,
    /// None does (none registered, or none healthy): the definitions are the last read.
    NoInstance,
}

impl ServiceCatalog {
    /// An entry read with `surface` (and no tools), for tests of what is built on it.
    #[cfg(test)]
    pub fn read_with(surface: Surface) -> Self {
        let mut entry = ServiceCatalog::new(
            &Presence {
                instances: 1,
                serving: true,
                read: None,
            },
            SystemTime::now(),
        );
        entry.surface = surface;
        entry.read_at = "2026-01-01T00:00:00.000Z".into();
        entry
    }

    fn new(presence: &Presence, now: SystemTime) -> Self {
        let mut entry = ServiceCatalog {
            registered: Vec::new(),
            tools: Vec::new(),
            surface: Surface::default(),
            from_instance: String::new(),
            protocol_version: String::new(),
            read_at: String::new(),
            error: None,
            warnings: Vec::new(),
            failures: 0,
            state: ServiceState::NoInstance,
            instances: 0,
            no_instance_since: None,
            tried: None,
        };
        entry.observe(presence, now);
        entry
    }

    /// Takes the service's state from the registry; `true` when it changed.
    fn observe(&mut self, presence: &Presence, now: SystemTime) -> bool {
        let (state, since) = if presence.serving {
            (ServiceState::Serving, None)
        } else if self.state == ServiceState::NoInstance && self.no_instance_since.is_some() {
            (ServiceState::NoInstance, self.no_instance_since.clone())
        } else {
            let now = humantime::format_rfc3339_millis(now).to_string();
            (ServiceState::NoInstance, Some(now))
        };
        let changed = self.state != state
            || self.instances != presence.instances
            || self.no_instance_since != since;
        self.state = state;
        self.instances = presence.instances;
        self.no_instance_since = since;
        changed
    }

    fn retry_due(&self) -> bool {
        let wait = toolgate_model::backoff::ceiling(
            RETRY_AFTER,
            RETRY_MAX,
            self.failures.saturating_sub(1),
        );
        self.error.is_some() && self.tried.is_none_or(|t| t.elapsed() >= wait)
    }
}

/// A server's resources, resource templates and prompts, as it listed them (each at most
/// [`MAX_SURFACE_ITEMS`]), and whether its capabilities offer them at all. Read with its tools,
/// at the same moments: a server whose resources change while its tool list stays is not read
/// again for them.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Surface {
    pub offers_resources: bool,
    pub offers_prompts: bool,
    /// `logging` and `completions` in its capabilities: the gateway passes `logging/setLevel`
    /// on to it and routes `completion/complete` to it.
    pub offers_logging: bool,
    pub offers_completions: bool,
    /// `resources.subscribe` in its capabilities: its updates reach a client's GET stream on
    /// the aggregate endpoint (`aggregate::relay`).
    pub offers_subscribe: bool,
    pub resources: Vec<Value>,
    pub resource_templates: Vec<Value>,
    pub prompts: Vec<Value>,
}

/// Resources, templates or prompts kept per service: each goes into every Envoy's filter
/// configuration (by its URI or name), so a server listing a whole file system is cut here.
pub const MAX_SURFACE_ITEMS: usize = 1_000;

impl Surface {
    /// What the filters route by: prompt names, resource URIs and templates.
    pub fn routes(&self) -> crate::registry::SurfaceRoutes {
        let strings = |items: &[Value], field: &str| -> Vec<String> {
            items
                .iter()
                .filter_map(|v| v.get(field)?.as_str())
                .filter(|s| s.len() <= toolgate_model::virtual_server::MAX_URI_LEN)
                .map(str::to_string)
                .collect()
        };
        crate::registry::SurfaceRoutes {
            prompts: strings(&self.prompts, "name"),
            resources: strings(&self.resources, "uri"),
            templates: strings(&self.resource_templates, "uriTemplate"),
        }
    }
}

/// Every service's catalog entry, shared with the admin API and the aggregate endpoint.
pub struct Catalog {
    services: RwLock<BTreeMap<String, ServiceCatalog>>,
    /// Bumped after every change of an entry, for whoever builds on the definitions.
    changes: watch::Sender<u64>,
}

impl Default for Catalog {
    fn default() -> Self {
        Catalog {
            services: RwLock::default(),
            changes: watch::Sender::new(0),
        }
    }
}

impl Catalog {
    pub fn view(&self) -> BTreeMap<String, ServiceCatalog> {
        self.read().clone()
    }

    /// The entries, without copying them (hold it briefly: the builder waits for it).
    pub fn read(&self) -> RwLockReadGuard<'_, BTreeMap<String, ServiceCatalog>> {
        self.services.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Changes whenever an entry changed.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    fn changed(&self) {
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
    }
}

/// What the registry says of one service it knows.
struct Presence {
    /// Its registrations (instance keys in etcd).
    instances: usize,
    /// Whether one of them takes calls (UP or UNHEALTHY).
    serving: bool,
    /// What to read, while an instance is UP.
    read: Option<Wanted>,
}

/// What a service needs read: the newest registration's tool list and where to read it.
struct Wanted {
    service: String,
    registered: Vec<String>,
    instance: String,
    url: String,
    warnings: Vec<String>,
    /// The service's registrations.
    instances: usize,
}

/// Keeps the catalog in step with the registry until the process ends: a pass on every state
/// the registry publishes (`snapshots`), and one a second for the retries. What a read learns
/// of a server's revision goes back to the registry (`Registry::set_legacy_revision`), and a
/// change of it to the filters through `publisher`. A read carries the service's credential
/// from `credentials`.
pub async fn run(
    registry: Arc<RwLock<Registry>>,
    catalog: Arc<Catalog>,
    mut snapshots: watch::Receiver<Arc<RoutingSnapshot>>,
    publisher: Publisher,
    http: reqwest::Client,
    timeout: Duration,
    credentials: Credentials,
) {
    let mut every = tokio::time::interval(Duration::from_secs(1));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut publishing = true;
    loop {
        tokio::select! {
            changed = snapshots.changed(), if publishing => {
                // The publisher is gone only at shutdown; the timer carries on meanwhile.
                publishing = changed.is_ok();
            }
            _ = every.tick() => {}
        }
        let present = {
            let reg = registry.read().unwrap_or_else(|p| p.into_inner());
            present(&reg)
        };
        let now = SystemTime::now();
        let (due, gone): (Vec<Wanted>, Vec<String>) = {
            let mut services = catalog.services.write().unwrap_or_else(|p| p.into_inner());
            // Only a service the registry forgot leaves the catalog; one without instances
            // stays, with its last definitions.
            let gone: Vec<String> = services
                .keys()
                .filter(|s| !present.contains_key(*s))
                .cloned()
                .collect();
            let mut changed = !gone.is_empty();
            services.retain(|s, _| present.contains_key(s));
            for (service, entry) in services.iter_mut() {
                if let Some(p) = present.get(service) {
                    changed |= entry.observe(p, now);
                }
            }
            if changed {
                catalog.changed();
            }
            let due = present
                .into_values()
                .filter_map(|p| p.read)
                .filter(|w| match services.get(&w.service) {
                    None => true,
                    Some(c) if c.registered != w.registered => true,
                    Some(c) => c.retry_due(),
                })
                .take(READS_PER_PASS)
                .collect();
            (due, gone)
        };
        if !gone.is_empty() {
            // The registry leaves a gone service out of the filters' configuration already;
            // forgetting it keeps a later service of that name from inheriting it before its
            // own read. (The registry's lock is never taken under the catalog's.)
            let mut reg = registry.write().unwrap_or_else(|p| p.into_inner());
            for s in &gone {
                reg.set_legacy_revision(s, None);
                reg.set_discovered_tools(s, None);
                reg.set_definitions(s, None);
                reg.set_surface(s, None);
            }
        }
        for w in due {
            let header = ExtraHeader::of(credentials.header(&w.service));
            let read = read_tools(&http, &w, timeout, header).await;
            let mut services = catalog.services.write().unwrap_or_else(|p| p.into_inner());
            // Read from an UP instance: serving, unless the registry said otherwise since (the
            // next pass corrects it).
            let entry = services.entry(w.service.clone()).or_insert_with(|| {
                ServiceCatalog::new(
                    &Presence {
                        instances: w.instances,
                        serving: true,
                        read: None,
                    },
                    SystemTime::now(),
                )
            });
            if entry.registered != w.registered {
                entry.failures = 0;
            }
            entry.registered = w.registered.clone();
            entry.tried = Some(Instant::now());
            entry.from_instance = w.instance.clone();
            match read {
                Ok((tools, surface, version, mut warnings)) => {
                    info!(service = %w.service, instance = %w.instance, tools = tools.len(),
                        %version, "tool catalog read");
                    for note in &warnings {
                        warn!(service = %w.service, "tool catalog: {note}");
                    }
                    warnings.splice(0..0, w.warnings.iter().cloned());
                    entry.tools = tools;
                    entry.surface = surface;
                    entry.protocol_version = version;
                    entry.read_at = humantime::format_rfc3339_millis(SystemTime::now()).to_string();
                    entry.error = None;
                    entry.failures = 0;
                    entry.warnings = warnings;
                }
                Err(e) => {
                    // Once per distinct failure; the retries in between are quiet.
                    if entry.error.as_deref() != Some(e.as_str()) {
                        warn!(service = %w.service, instance = %w.instance, error = %e,
                            "reading the tool catalog failed; keeping the last one, retrying with backoff");
                    }
                    entry.failures = entry.failures.saturating_add(1);
                    entry.error = Some(e);
                    entry.warnings = w.warnings.clone();
                }
            }
            let legacy = legacy_revision(&entry.protocol_version);
            let discovered = discovered_names(&w.registered, entry);
            // The filters' offline listings show the last definitions read (a failed read
            // keeps them).
            let definitions = (!entry.read_at.is_empty()).then(|| entry.tools.clone());
            let surface = (!entry.read_at.is_empty()).then(|| entry.surface.routes());
            drop(services);
            catalog.changed();
            let changed = {
                let mut reg = registry.write().unwrap_or_else(|p| p.into_inner());
                let legacy = reg.set_legacy_revision(&w.service, legacy);
                let definitions =
                    definitions.is_some_and(|d| reg.set_definitions(&w.service, Some(d)));
                let surface = surface.is_some_and(|s| reg.set_surface(&w.service, Some(s)));
                reg.set_discovered_tools(&w.service, discovered) || legacy || definitions || surface
            };
            if changed {
                publisher.changed(Instant::now());
            }
        }
    }
}

/// The names a service's server listed, for a service whose registrations list none, once a
/// read succeeded (`None` otherwise: the registrations' list is the catalog).
fn discovered_names(
    registered: &[String],
    entry: &ServiceCatalog,
) -> Option<std::collections::BTreeSet<String>> {
    if !registered.is_empty() || entry.read_at.is_empty() {
        return None;
    }
    Some(
        entry
            .tools
            .iter()
            .filter_map(|d| d.get("name")?.as_str())
            .filter(|n| toolgate_model::validate_name("tool", n).is_ok())
            .map(str::to_string)
            .collect(),
    )
}

/// The revision a 2026-07-28 client's calls to a server must be made in, on a session the
/// gateway holds: the one the catalog agreed on, when that is not 2026-07-28 (the catalog
/// offers 2026-07-28 first, so a server that speaks it is never recorded). `None` also
/// before any read succeeded.
fn legacy_revision(agreed: &str) -> Option<String> {
    (!agreed.is_empty() && agreed != STATELESS_REVISION).then(|| agreed.to_string())
}

/// Every service the registry knows (also one whose instances all left), with what to read
/// from it while an instance is UP (the entry read before stays meanwhile).
fn present(reg: &Registry) -> BTreeMap<String, Presence> {
    let mut by_service: BTreeMap<String, Vec<(&str, &crate::registry::Instance)>> = reg
        .service_names()
        .map(|s| (s.clone(), Vec::new()))
        .collect();
    for (key, inst) in reg.instances() {
        by_service
            .entry(key.service.clone())
            .or_default()
            .push((key.instance.as_str(), inst));
    }
    by_service
        .into_iter()
        .map(|(service, instances)| {
            let serving = instances
                .iter()
                .any(|(_, i)| matches!(i.health.state(), State::Up | State::Unhealthy));
            let read = wanted(&service, &instances);
            let presence = Presence {
                instances: instances.len(),
                serving,
                read,
            };
            (service, presence)
        })
        .collect()
}

/// What to read of one service, or `None` while no instance is UP (nothing to read from).
fn wanted(service: &str, instances: &[(&str, &crate::registry::Instance)]) -> Option<Wanted> {
    let (newest_id, newest) = instances.iter().max_by_key(|(_, i)| i.mod_revision)?;
    let mut warnings = Vec::new();
    let mut sorted_newest = newest.meta.tools.clone();
    sorted_newest.sort();
    for (id, inst) in instances {
        let mut theirs = inst.meta.tools.clone();
        theirs.sort();
        if theirs != sorted_newest {
            warnings.push(format!(
                "instances disagree on their tools: {id} registers {:?}, the newest \
                 registration ({newest_id}) {:?}; the catalog shows the newest's",
                inst.meta.tools, newest.meta.tools
            ));
        }
    }
    // Read from an UP instance with the newest list, else from any UP one.
    let (id, inst) = instances
        .iter()
        .filter(|(_, i)| i.health.state() == State::Up)
        .max_by_key(|(_, i)| (i.meta.tools == newest.meta.tools, i.mod_revision))?;
    Some(Wanted {
        service: service.to_string(),
        registered: newest.meta.tools.clone(),
        instance: id.to_string(),
        url: toolgate_probe::http::url(inst.addr(), &inst.meta.mcp_path),
        warnings,
        instances: instances.len(),
    })
}

/// Every page of one list method (`resources/list`...), up to [`MAX_SURFACE_ITEMS`] items;
/// a failure or a cut is a warning, and what was read so far stays.
async fn list_all(
    client: &mut McpClient,
    method: &str,
    field: &str,
    warnings: &mut Vec<String>,
) -> Vec<Value> {
    let mut items = Vec::new();
    let mut cursor: Option<String> = None;
    for _ in 0..ListLimits::default().max_pages {
        let params = match &cursor {
            Some(c) => serde_json::json!({ "cursor": c }),
            None => serde_json::json!({}),
        };
        let page = match client.request(method, params).await {
            Ok(page) => page,
            Err(e) => {
                warnings.push(format!("{method}: {e}"));
                return items;
            }
        };
        let listed = page.get(field).and_then(Value::as_array);
        for item in listed.into_iter().flatten() {
            if items.len() == MAX_SURFACE_ITEMS {
                warnings.push(format!(
                    "{method}: stopped at {MAX_SURFACE_ITEMS}; the server lists more"
                ));
                return items;
            }
            if item.is_object() {
                items.push(item.clone());
            }
        }
        match page.get("nextCursor").and_then(Value::as_str) {
            Some(next) if cursor.as_deref() != Some(next) => cursor = Some(next.to_string()),
            _ => return items,
        }
    }
    warnings.push(format!(
        "{method}: stopped after {} pages",
        ListLimits::default().max_pages
    ));
    items
}

/// Reads what the server offers besides tools, as its capabilities say.
async fn read_surface(client: &mut McpClient, warnings: &mut Vec<String>) -> Surface {
    let caps = client.capabilities().clone();
    let mut surface = Surface {
        offers_resources: caps.get("resources").is_some_and(Value::is_object),
        offers_prompts: caps.get("prompts").is_some_and(Value::is_object),
        offers_logging: caps.get("logging").is_some_and(Value::is_object),
        offers_completions: caps.get("completions").is_some_and(Value::is_object),
        offers_subscribe: caps.pointer("/resources/subscribe") == Some(&Value::Bool(true)),
        ..Surface::default()
    };
    if surface.offers_resources {
        surface.resources = list_all(client, "resources/list", "resources", warnings).await;
        surface.resource_templates = list_all(
            client,
            "resources/templates/list",
            "resourceTemplates",
            warnings,
        )
        .await;
    }
    if surface.offers_prompts {
        surface.prompts = list_all(client, "prompts/list", "prompts", warnings).await;
    }
    surface
}

/// Lists the tools of one instance and keeps the definitions of the registered ones, with
/// what it offers besides tools. Every request carries `header` (the service's credential).
async fn read_tools(
    http: &reqwest::Client,
    w: &Wanted,
    timeout: Duration,
    header: Option<ExtraHeader>,
) -> Result<(Vec<Value>, Surface, String, Vec<String>), String> {
    let mut client = McpClient::new(http.clone(), w.url.clone(), timeout, CLIENT_NAME)
        .offering(toolgate_probe::mcp::offered_for_listing());
    client.set_header(header);
    let listed = client.list_tools(ListLimits::default()).await;
    let mut surface_warnings = Vec::new();
    let surface = if listed.is_ok() {
        read_surface(&mut client, &mut surface_warnings).await
    } else {
        Surface::default()
    };
    let version = client
        .negotiated()
        .map(|n| n.version().to_string())
        .unwrap_or_default();
    // The builder keeps no session between reads.
    let _ = client.close().await;
    let listing = listed.map_err(|e| format!("tools/list at {}: {e}", w.url))?;
    let mut warnings: Vec<String> = surface_warnings;
    warnings.extend(
        listing
            .refused
            .iter()
            .map(|r| format!("the server lists tool {:?}, refused: {}", r.name, r.why)),
    );
    if let Some(cut) = &listing.cut {
        warnings.push(format!("the listing was cut: {cut}"));
    }
    let tools: Vec<Value> = if w.registered.is_empty() {
        listing.definitions
    } else {
        let missing: Vec<&String> = w
            .registered
            .iter()
            .filter(|t| !listing.names.contains(t))
            .collect();
        if !missing.is_empty() {
            warnings.push(format!(
                "registered but not listed by {}: {missing:?}",
                w.instance
            ));
        }
        listing
            .definitions
            .into_iter()
            .zip(listing.names)
            .filter(|(_, name)| w.registered.contains(name))
            .map(|(d, _)| d)
            .collect()
    };
    Ok((tools, surface, version, warnings))
}

#[cfg(test)]
mod tests {
    use super::*;
    use toolgate_model::KeyLayout;

    fn serving(instances: usize) -> Presence {
        Presence {
            instances,
            serving: true,
            read: None,
        }
    }

    fn without(instances: usize) -> Presence {
        Presence {
            instances,
            serving: false,
            read: None,
        }
    }

    #[test]
    fn a_service_whose_instances_left_is_still_present_with_nothing_to_read() {
        let mut reg = Registry::new(KeyLayout::default());
        reg.put(
            "/mcp/services/fin/i-1",
            br#"{"instance_id":"i-1","endpoint":"127.0.0.1:9002","tools":["pay"]}"#,
            7,
            3,
            3,
        )
        .expect("fin");
        let p = present(&reg);
        assert_eq!(p["fin"].instances, 1);
        // Without probes an instance is UP from its registration.
        assert!(p["fin"].serving);
        assert_eq!(p["fin"].read.as_ref().map(|w| w.instances), Some(1));
        assert_eq!(reg.delete("/mcp/services/fin/i-1"), Ok(true));
        let p = present(&reg);
        assert_eq!(p["fin"].instances, 0, "known, without instances");
        assert!(!p["fin"].serving && p["fin"].read.is_none());
    }

    #[test]
    fn the_state_follows_the_registry_and_remembers_since_when_nothing_serves() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let later = t0 + Duration::from_secs(60);
        let mut c = ServiceCatalog::new(&serving(2), t0);
        assert_eq!(c.state, ServiceState::Serving);
        assert_eq!((c.instances, c.no_instance_since.as_deref()), (2, None));
        assert!(!c.observe(&serving(2), later), "nothing changed");
        assert!(c.observe(&without(1), t0));
        assert_eq!(c.state, ServiceState::NoInstance);
        let since = c.no_instance_since.clone();
        assert_eq!(since.as_deref(), Some("2023-11-14T22:13:20.000Z"));
        assert!(c.observe(&without(0), later), "the last one left");
        assert_eq!(c.no_instance_since, since, "still since the first moment");
        assert!(!c.observe(&without(0), later));
        assert!(c.observe(&serving(1), later));
        assert_eq!(
            (c.state, c.no_instance_since.as_deref()),
            (ServiceState::Serving, None)
        );
        let json = serde_json::to_value(&c).expect("json");
        assert_eq!(json["state"], "serving");
        assert!(json["no_instance_since"].is_null());
    }

    #[test]
    fn only_a_server_without_2026_07_28_needs_a_held_session() {
        assert_eq!(legacy_revision(""), None);
        assert_eq!(legacy_revision("2026-07-28"), None);
        assert_eq!(legacy_revision("2025-06-18"), Some("2025-06-18".into()));
    }

    #[test]
    fn failed_reads_back_off_to_five_minutes() {
        let mut c = ServiceCatalog::new(&serving(1), SystemTime::now());
        c.tried = Some(Instant::now());
        assert!(!c.retry_due(), "nothing to retry without an error");
        c.error = Some("tools/list: HTTP 404".into());
        c.failures = 1;
        assert!(!c.retry_due(), "not before 10 s");
        c.tried = Instant::now().checked_sub(Duration::from_secs(11));
        assert!(c.retry_due());
        c.failures = 3;
        assert!(!c.retry_due(), "the third failure waits 40 s");
        c.failures = 60;
        c.tried = Instant::now().checked_sub(Duration::from_secs(299));
        assert!(!c.retry_due(), "capped at 300 s, not overflowed");
        c.tried = Instant::now().checked_sub(Duration::from_secs(301));
        assert!(c.retry_due());
    }
}
