//! What `tools/list` shows on one virtual server, built from the registry and the catalog when
//! either changes (never per request), with each tool's availability: a tool whose service has
//! no serving instance, whose breaker is open fleet-wide, or that an operator forced open is
//! annotated or hidden, as the virtual server says.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use serde_json::value::RawValue;
use serde_json::{json, Map, Value};
use toolgate_model::availability::annotate;
pub use toolgate_model::availability::{Availability, Unavailable, AVAILABILITY_KEY};
use toolgate_model::fleet::OverrideMode;
use toolgate_model::policy::FilterConfig;
use toolgate_model::virtual_server::{
    unprefixed_uri, VirtualRoutes, VirtualServer, VirtualTemplate, WhenUnavailable,
};

use crate::catalog::{ServiceCatalog, Surface};
use crate::health::machine::State;
use crate::registry::Registry;

/// Tools per `tools/list` page.
pub const PAGE_SIZE: usize = 100;
/// Prefix of a pagination cursor.
const CURSOR_PREFIX: &str = "tgc1.";

/// One virtual server's `tools/list`, ready to page through.
#[derive(Debug, Clone, Default)]
pub struct Listing {
    /// The virtual server's `description`, shown as `instructions`.
    pub instructions: Option<String>,
    /// Tools as shown, by visible name.
    pub tools: Vec<ShownTool>,
    /// The same tools as JSON text, written once when the listing is built: serving a page
    /// copies bytes instead of copying and serializing 100 definitions per request.
    rendered: Vec<Box<RawValue>>,
    /// Names and availability (and which definitions were read) of what is shown: when it
    /// changes, clients are told `notifications/tools/list_changed`.
    pub fingerprint: u64,
    /// When the earliest fleet breaker this listing shows open closes (ms since the epoch): the
    /// listing is due again then, even if nothing else changes.
    pub next_expiry_ms: Option<u64>,
    /// The resources, templates and prompts of the same services, and the capabilities
    /// (`None`: none; an `Option`, as a default one would hold listings that hold one).
    pub surface: Option<Arc<SurfaceListing>>,
}

/// What a virtual server lists besides tools, each list in the order of what it is paged by
/// (the visible URI, template or name), with the capabilities that follow from it.
#[derive(Debug, Clone, Default)]
pub struct SurfaceListing {
    pub resources: Listing,
    pub templates: Listing,
    pub prompts: Listing,
    /// Whether a serving service of this virtual server offers resources, prompts, logging,
    /// completions.
    pub offers_resources: bool,
    pub offers_prompts: bool,
    pub offers_logging: bool,
    pub offers_completions: bool,
    pub offers_subscribe: bool,
}

impl Listing {
    /// The `capabilities` of `initialize` and `server/discover`: tools (clients are told when
    /// their list changes), and resources and prompts when a serving service of this virtual
    /// server offers them.
    pub fn capabilities(&self) -> Value {
        match &self.surface {
            Some(s) => s.capabilities(),
            None => SurfaceListing::default().capabilities(),
        }
    }

    /// The same for a legacy client (`initialize`): `resources.subscribe` too where a serving
    /// service offers it, since its updates reach the client's GET stream. A 2026-07-28
    /// client has no such stream from the gateway.
    pub fn legacy_capabilities(&self) -> Value {
        let mut caps = self.capabilities();
        if self.surface.as_ref().is_some_and(|s| s.offers_subscribe) {
            if let Some(resources) = caps.get_mut("resources").and_then(Value::as_object_mut) {
                resources.insert("subscribe".into(), json!(true));
            }
        }
        caps
    }
}

impl SurfaceListing {
    fn capabilities(&self) -> Value {
        let mut caps = Map::new();
        caps.insert("tools".into(), json!({"listChanged": true}));
        if self.offers_resources {
            caps.insert("resources".into(), json!({}));
        }
        if self.offers_prompts {
            caps.insert("prompts".into(), json!({}));
        }
        // `logging/setLevel` is passed on to every session held for the client; messages a
        // server logs during a call reach the client on that call's stream.
        if self.offers_logging {
            caps.insert("logging".into(), json!({}));
        }
        if self.offers_completions {
            caps.insert("completions".into(), json!({}));
        }
        Value::Object(caps)
    }
}

/// A tool as shown: its visible name and its definition.
pub type ShownTool = (String, Value);

/// One page of a listing.
#[derive(Debug)]
pub struct Page<'a> {
    pub tools: &'a [ShownTool],
    /// `tools` as JSON text.
    pub rendered: &'a [Box<RawValue>],
    /// The cursor of the next page, if there is one.
    pub next: Option<String>,
}

/// The error of a cursor this server did not make.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadCursor(pub String);

impl Listing {
    /// The page after `cursor`, and the cursor of the next page if there is one. A cursor is
    /// the last name of its page, so a listing that changes between pages neither repeats nor
    /// skips a tool that stays.
    pub fn page(&self, cursor: Option<&str>) -> Result<Page<'_>, BadCursor> {
        let start = match cursor {
            None => 0,
            Some(c) => {
                let after = decode_cursor(c).ok_or_else(|| BadCursor(c.to_string()))?;
                self.tools
                    .partition_point(|(name, _)| name.as_str() <= after.as_str())
            }
        };
        let end = (start + PAGE_SIZE).min(self.tools.len());
        let tools = &self.tools[start..end];
        let next = match tools.last() {
            Some((last, _)) if end < self.tools.len() => Some(encode_cursor(last)),
            _ => None,
        };
        Ok(Page {
            tools,
            rendered: &self.rendered[start..end],
            next,
        })
    }

    /// Adds a tool (in name order), with its JSON text.
    pub fn push(&mut self, name: String, tool: Value) {
        // A `Value` always serializes (its keys are strings); should it not, the tool is left
        // out of both lists rather than shown in one.
        if let Ok(raw) = serde_json::value::to_raw_value(&tool) {
            self.tools.push((name, tool));
            self.rendered.push(raw);
        }
    }

    /// A listing of `tools` (in name order).
    pub fn of(instructions: Option<String>, tools: Vec<ShownTool>) -> Listing {
        let mut listing = Listing {
            instructions,
            ..Listing::default()
        };
        for (name, tool) in tools {
            listing.push(name, tool);
        }
        listing
    }
}

fn encode_cursor(after: &str) -> String {
    format!("{CURSOR_PREFIX}{}", URL_SAFE_NO_PAD.encode(after))
}

fn decode_cursor(cursor: &str) -> Option<String> {
    if cursor.len() > 1024 {
        return None;
    }
    let raw = URL_SAFE_NO_PAD
        .decode(cursor.strip_prefix(CURSOR_PREFIX)?)
        .ok()?;
    String::from_utf8(raw).ok()
}

/// What every listing of one refresh reads: taken once, shared by the virtual servers.
pub struct Inputs<'a> {
    pub servers: BTreeMap<String, VirtualServer>,
    pub config: Arc<FilterConfig>,
    /// Services with at least one instance that takes calls (UP, or UNHEALTHY at a reduced
    /// weight: Envoy still routes to it).
    pub serving: BTreeSet<String>,
    /// service → tool → definition, and the service's read time.
    pub definitions: HashMap<&'a str, (HashMap<&'a str, &'a Value>, &'a str)>,
    /// service → what its server offers besides tools, by prompt name, URI and template.
    pub surfaces: HashMap<&'a str, SurfaceIndex<'a>>,
    pub now_ms: u64,
}

/// One service's resources, templates and prompts as read, by what the routes name them.
pub struct SurfaceIndex<'a> {
    pub surface: &'a Surface,
    pub prompts: HashMap<&'a str, &'a Value>,
    pub resources: HashMap<&'a str, &'a Value>,
    pub templates: HashMap<&'a str, &'a Value>,
}

impl<'a> SurfaceIndex<'a> {
    fn of(surface: &'a Surface) -> Self {
        let by = |items: &'a [Value], field: &str| -> HashMap<&'a str, &'a Value> {
            items
                .iter()
                .filter_map(|v| Some((v.get(field)?.as_str()?, v)))
                .collect()
        };
        SurfaceIndex {
            surface,
            prompts: by(&surface.prompts, "name"),
            resources: by(&surface.resources, "uri"),
            templates: by(&surface.resource_templates, "uriTemplate"),
        }
    }
}

impl<'a> Inputs<'a> {
    pub fn read(
        reg: &Registry,
        catalog: &'a BTreeMap<String, ServiceCatalog>,
        now_ms: u64,
    ) -> Self {
        // Instances come ordered by service: one name per service, not one copy per instance.
        let mut serving = BTreeSet::new();
        let mut last: Option<&str> = None;
        for (k, i) in reg.instances() {
            if last != Some(k.service.as_str())
                && matches!(i.health.state(), State::Up | State::Unhealthy)
            {
                serving.insert(k.service.clone());
                last = Some(k.service.as_str());
            }
        }
        let definitions = catalog
            .iter()
            .map(|(service, entry)| {
                let tools = entry
                    .tools
                    .iter()
                    .filter_map(|d| Some((d.get("name")?.as_str()?, d)))
                    .collect();
                (service.as_str(), (tools, entry.read_at.as_str()))
            })
            .collect();
        let surfaces = catalog
            .iter()
            .map(|(service, entry)| (service.as_str(), SurfaceIndex::of(&entry.surface)))
            .collect();
        Inputs {
            servers: reg.virtual_servers(),
            config: reg.filter_config(),
            serving,
            definitions,
            surfaces,
            now_ms,
        }
    }

    fn availability(
        &self,
        routes: &VirtualRoutes,
        service: &str,
        tool: &str,
    ) -> Option<Availability> {
        let forced = self
            .config
            .overrides
            .get(service)
            .and_then(|t| t.get(tool))
            .filter(|o| o.mode == OverrideMode::ForceOpen);
        let why = if let Some(o) = forced {
            Unavailable::ForcedOpen {
                reason: o.reason.clone(),
            }
        } else if !self.serving.contains(service) {
            Unavailable::NoInstance
        } else {
            let open = self
                .config
                .fleet_open
                .get(service)
                .and_then(|t| t.get(tool))
                .filter(|o| o.until_ms > self.now_ms)?;
            Unavailable::Open {
                until_ms: open.until_ms,
            }
        };
        let fallback = self
            .config
            .policy_for(service, tool)
            .fallback_tool
            .and_then(|f| routes.visible_name(service, &f).map(str::to_string));
        Some(Availability { why, fallback })
    }

    /// The listing of one virtual server.
    pub fn listing(&self, name: &str) -> Option<Listing> {
        let vs = self.servers.get(name)?;
        let empty = VirtualRoutes::default();
        let routes = self.config.virtual_servers.get(name).unwrap_or(&empty);
        let mut hasher = DefaultHasher::new();
        let mut listing = Listing {
            instructions: vs.description.clone(),
            ..Listing::default()
        };
        // BTreeMap order: by visible name.
        for (visible, target) in &routes.tools {
            let avail = self.availability(routes, &target.service, &target.tool);
            if let Some(Availability {
                why: Unavailable::Open { until_ms },
                ..
            }) = &avail
            {
                listing.next_expiry_ms = Some(
                    listing
                        .next_expiry_ms
                        .map_or(*until_ms, |m| m.min(*until_ms)),
                );
            }
            if avail.is_some() && vs.unavailable == WhenUnavailable::Hide {
                continue;
            }
            let (def, read_at) = match self.definitions.get(target.service.as_str()) {
                Some((tools, read_at)) => (tools.get(target.tool.as_str()).copied(), *read_at),
                None => (None, ""),
            };
            (
                visible,
                &target.service,
                &target.tool,
                &avail,
                def.is_some(),
                read_at,
            )
                .hash(&mut hasher);
            listing.push(visible.clone(), render(visible, def, avail.as_ref()));
        }
        listing.fingerprint = hasher.finish();
        listing.surface = Some(Arc::new(self.surface_listing(vs, routes)));
        Some(listing)
    }

    /// The resources, templates and prompts of one virtual server: each as its server listed
    /// it under the name or URI the agent sees. One of a service without a serving instance
    /// is annotated like a tool (`no_instance`), or hidden, as the virtual server says.
    fn surface_listing(&self, vs: &VirtualServer, routes: &VirtualRoutes) -> SurfaceListing {
        let mut out = SurfaceListing::default();
        let no_instance = Availability {
            why: Unavailable::NoInstance,
            fallback: None,
        };
        // `None`: hidden; else the availability to show, if any.
        let shown = |service: &str| -> Option<Option<&Availability>> {
            if self.serving.contains(service) {
                Some(None)
            } else if vs.unavailable == WhenUnavailable::Hide {
                None
            } else {
                Some(Some(&no_instance))
            }
        };
        let render = |def: &Value, field: &str, visible: &str, avail: Option<&Availability>| {
            let mut item = def.as_object().cloned().unwrap_or_default();
            item.insert(field.into(), json!(visible));
            if let Some(a) = avail {
                annotate(&mut item, a);
            }
            Value::Object(item)
        };
        for (service, index) in &self.surfaces {
            if vs.offers_service(service) && self.serving.contains(*service) {
                out.offers_resources |= index.surface.offers_resources;
                out.offers_prompts |= index.surface.offers_prompts;
                out.offers_logging |= index.surface.offers_logging;
                out.offers_completions |= index.surface.offers_completions;
                out.offers_subscribe |= index.surface.offers_subscribe;
            }
        }
        for (visible, t) in &routes.prompts {
            let Some(def) = self
                .surfaces
                .get(t.service.as_str())
                .and_then(|i| i.prompts.get(t.tool.as_str()))
            else {
                continue;
            };
            if let Some(avail) = shown(&t.service) {
                out.prompts
                    .push(visible.clone(), render(def, "name", visible, avail));
            }
        }
        for (visible, t) in &routes.resources {
            let Some(def) = self
                .surfaces
                .get(t.service.as_str())
                .and_then(|i| i.resources.get(t.tool.as_str()))
            else {
                continue;
            };
            if let Some(avail) = shown(&t.service) {
                out.resources
                    .push(visible.clone(), render(def, "uri", visible, avail));
            }
        }
        let mut templates: Vec<&VirtualTemplate> = routes.templates.iter().collect();
        templates.sort_by(|a, b| a.visible.cmp(&b.visible));
        for t in templates {
            let own = unprefixed_uri(&t.visible)
                .filter(|(s, _)| *s == t.service)
                .map_or(t.visible.as_str(), |(_, inner)| inner);
            let index = self.surfaces.get(t.service.as_str());
            // The server's own template first: a server may offer a template that looks
            // rewritten.
            let def = index.and_then(|i| {
                i.templates
                    .get(t.visible.as_str())
                    .or_else(|| i.templates.get(own))
            });
            let Some(def) = def else {
                continue;
            };
            if let Some(avail) = shown(&t.service) {
                out.templates.push(
                    t.visible.clone(),
                    render(def, "uriTemplate", &t.visible, avail),
                );
            }
        }
        out
    }
}

/// A tool as shown: its definition from the catalog under its visible name (the last one
/// read, also while its service has no instance; a minimal valid one while none was ever
/// read), with its availability.
pub fn render(visible: &str, def: Option<&Value>, avail: Option<&Availability>) -> Value {
    let mut tool = match def {
        Some(Value::Object(m)) => m.clone(),
        _ => {
            let no_instance = avail.is_some_and(|a| a.why == Unavailable::NoInstance);
            let description = if no_instance {
                "The definition of this tool is not available yet; toolgate reads it from its \
                 server once the service has a healthy instance."
            } else {
                "The definition of this tool is not available yet; toolgate reads it from its \
                 server shortly."
            };
            let mut m = Map::new();
            m.insert("description".into(), json!(description));
            m
        }
    };
    tool.insert("name".into(), json!(visible));
    if !tool.get("inputSchema").is_some_and(Value::is_object) {
        tool.insert("inputSchema".into(), json!({"type": "object"}));
    }
    if let Some(a) = avail {
        annotate(&mut tool, a);
    }
    Value::Object(tool)
}

#[cfg(test)]
mod tests {
    use super::*;
    use toolgate_model::availability::rfc3339;
    use toolgate_model::KeyLayout;

    fn registry() -> Registry {
        let mut r = Registry::new(KeyLayout::default());
        r.put(
            "/mcp/services/inv/i-1",
            br#"{"instance_id":"i-1","endpoint":"127.0.0.1:9001","tools":["get_stock","get_stock_cached","reserve"]}"#,
            7,
            2,
            2,
        )
        .expect("inv");
        r.put(
            "/mcp/services/fin/i-1",
            br#"{"instance_id":"i-1","endpoint":"127.0.0.1:9002","tools":["pay"]}"#,
            7,
            3,
            3,
        )
        .expect("fin");
        r.routing(1, std::time::Instant::now());
        r
    }

    fn catalog() -> BTreeMap<String, ServiceCatalog> {
        BTreeMap::new()
    }

    fn names(l: &Listing) -> Vec<&str> {
        l.tools.iter().map(|(n, _)| n.as_str()).collect()
    }

    #[test]
    fn resources_and_prompts_are_merged_named_and_rewritten_where_they_collide() {
        let mut r = registry();
        let surface = |templates: &[&str]| Surface {
            offers_resources: true,
            offers_prompts: true,
            offers_logging: false,
            offers_completions: false,
            offers_subscribe: false,
            resources: vec![json!({"uri": "secret://report", "name": "report"})],
            resource_templates: templates
                .iter()
                .map(|t| json!({"uriTemplate": t, "name": "t"}))
                .collect(),
            prompts: vec![json!({"name": "greet", "description": "Greets."})],
        };
        let cat = BTreeMap::from([
            (
                "inv".to_string(),
                ServiceCatalog::read_with(surface(&["demo://{id}"])),
            ),
            (
                "fin".to_string(),
                ServiceCatalog::read_with(surface(&["demo://{id}"])),
            ),
        ]);
        for (service, entry) in &cat {
            assert!(r.set_surface(service, Some(entry.surface.routes())));
        }
        r.routing(2, std::time::Instant::now());
        let inputs = Inputs::read(&r, &cat, crate::fleet::now_ms());
        let l = inputs.listing("default").expect("default");
        let s = l.surface.as_deref().expect("a surface");
        assert_eq!(names(&s.prompts), ["fin__greet", "inv__greet"]);
        assert_eq!(s.prompts.tools[1].1["description"], "Greets.");
        // `inv` registered first (create revision 2): it keeps the URI and the template.
        assert_eq!(
            names(&s.resources),
            ["secret://report", "toolgate+fin:secret://report"]
        );
        assert_eq!(
            s.resources.tools[1].1["uri"],
            "toolgate+fin:secret://report"
        );
        assert_eq!(
            names(&s.templates),
            ["demo://{id}", "toolgate+fin:demo://{id}"]
        );
        let routes = &inputs.config.virtual_servers["default"];
        assert_eq!(routes.resources["secret://report"].service, "inv");
        assert_eq!(
            routes.resource_target("toolgate+fin:demo://7"),
            Some(("fin".into(), "demo://7".into()))
        );
        assert_eq!(
            l.capabilities(),
            json!({"tools": {"listChanged": true}, "resources": {}, "prompts": {}})
        );

        // `fin` loses its instance: its items are annotated, or hidden.
        assert_eq!(r.delete("/mcp/services/fin/i-1"), Ok(true));
        r.routing(3, std::time::Instant::now());
        let mut inputs = Inputs::read(&r, &cat, crate::fleet::now_ms());
        let l = inputs.listing("default").expect("default");
        let s = l.surface.as_deref().expect("a surface");
        assert_eq!(
            s.prompts.tools[0].1["_meta"][AVAILABILITY_KEY]["state"],
            "no_instance"
        );
        assert!(s.prompts.tools[1].1.get("_meta").is_none(), "inv serves");
        inputs.servers.insert(
            "default".into(),
            VirtualServer {
                unavailable: WhenUnavailable::Hide,
                ..VirtualServer::default()
            },
        );
        let l = inputs.listing("default").expect("default");
        let s = l.surface.as_deref().expect("a surface");
        assert_eq!(names(&s.prompts), ["inv__greet"]);
        assert_eq!(names(&s.resources), ["secret://report"]);
        assert_eq!(names(&s.templates), ["demo://{id}"]);
    }

    #[test]
    fn every_tool_is_listed_by_visible_name_with_a_minimal_definition_until_read() {
        let r = registry();
        let cat = catalog();
        let inputs = Inputs::read(&r, &cat, crate::fleet::now_ms());
        let l = inputs.listing("default").expect("default");
        assert_eq!(
            names(&l),
            [
                "fin__pay",
                "inv__get_stock",
                "inv__get_stock_cached",
                "inv__reserve"
            ]
        );
        let t = &l.tools[0].1;
        assert_eq!(t["inputSchema"], json!({"type": "object"}));
        assert!(t["description"]
            .as_str()
            .unwrap_or("")
            .contains("not available yet"));
        assert!(t.get("_meta").is_none(), "available: no annotation");
        assert!(inputs.listing("nope").is_none());
    }

    #[test]
    fn a_forced_open_tool_is_annotated_with_its_fallback() {
        let mut r = registry();
        r.put(
            "/mcp/overrides/inv/get_stock",
            br#"{"mode":"force_open","reason":"maintenance"}"#,
            0,
            5,
            5,
        )
        .expect("override");
        r.put(
            "/mcp/policies/inv/get_stock",
            br#"{"fallback_tool":"get_stock_cached"}"#,
            0,
            6,
            6,
        )
        .expect("policy");
        let cat = catalog();
        let before = Inputs::read(&registry(), &cat, 0)
            .listing("default")
            .expect("l");
        let l = Inputs::read(&r, &cat, crate::fleet::now_ms())
            .listing("default")
            .expect("l");
        assert_ne!(before.fingerprint, l.fingerprint);
        let t = &l.tools[1].1;
        assert_eq!(t["name"], "inv__get_stock");
        let a = &t["_meta"][AVAILABILITY_KEY];
        assert_eq!(a["state"], "forced_open");
        assert_eq!(a["fallback"], "inv__get_stock_cached");
        assert!(a["reason"].as_str().unwrap_or("").contains("maintenance"));
        let d = t["description"].as_str().unwrap_or("");
        assert!(d.ends_with("use inv__get_stock_cached instead."), "{d}");
    }

    #[test]
    fn an_open_breaker_says_until_when_and_expires_on_its_own() {
        let mut r = registry();
        let until = crate::fleet::now_ms() + 60_000;
        r.put(
            "/mcp/breakers/fin/pay",
            format!(r#"{{"until_ms":{until},"opened_by":"gw-a","opened_at_ms":1}}"#).as_bytes(),
            0,
            5,
            5,
        )
        .expect("fleet");
        let cat = catalog();
        let l = Inputs::read(&r, &cat, until - 1000)
            .listing("default")
            .expect("l");
        let a = &l.tools[0].1["_meta"][AVAILABILITY_KEY];
        assert_eq!(a["state"], "open");
        assert_eq!(a["until"], json!(rfc3339(until)));
        assert!(a.get("fallback").is_none());
        assert_eq!(l.next_expiry_ms, Some(until));
        let later = Inputs::read(&r, &cat, until + 1)
            .listing("default")
            .expect("l");
        assert!(
            later.tools[0].1.get("_meta").is_none(),
            "closed once past until"
        );
    }

    #[test]
    fn a_service_without_instances_is_annotated_or_hidden() {
        let mut r = registry();
        assert_eq!(r.delete("/mcp/services/fin/i-1"), Ok(true));
        r.routing(2, std::time::Instant::now());
        let cat = catalog();
        let inputs = Inputs::read(&r, &cat, 0);
        let l = inputs.listing("default").expect("l");
        assert_eq!(l.tools[0].0, "fin__pay");
        assert_eq!(
            l.tools[0].1["_meta"][AVAILABILITY_KEY]["state"],
            "no_instance"
        );
        let d = l.tools[0].1["description"].as_str().unwrap_or("");
        assert!(
            d.contains("not available yet")
                && d.contains("once the service has a healthy")
                && !d.contains("shortly"),
            "never read, and nothing to read it from: {d}"
        );

        let mut hiding = Inputs::read(&r, &cat, 0);
        hiding.servers.insert(
            "default".into(),
            VirtualServer {
                unavailable: WhenUnavailable::Hide,
                ..VirtualServer::default()
            },
        );
        let l = hiding.listing("default").expect("l");
        assert_eq!(
            names(&l),
            ["inv__get_stock", "inv__get_stock_cached", "inv__reserve"]
        );
    }

    #[test]
    fn a_read_definition_keeps_everything_but_the_name() {
        let def = json!({
            "name": "get_stock", "title": "Stock", "description": "Stock of an item.",
            "inputSchema": {"type": "object", "properties": {"sku": {"type": "string"}}},
            "outputSchema": {"type": "object"}, "annotations": {"readOnlyHint": true},
            "icons": [{"src": "https://example.com/i.png"}], "_meta": {"x": 1}
        });
        let avail = Availability {
            why: Unavailable::NoInstance,
            fallback: None,
        };
        let t = render("inv__get_stock", Some(&def), Some(&avail));
        assert_eq!(t["name"], "inv__get_stock");
        for k in [
            "title",
            "inputSchema",
            "outputSchema",
            "annotations",
            "icons",
        ] {
            assert_eq!(t[k], def[k], "{k}");
        }
        assert_eq!(t["_meta"]["x"], 1);
        assert_eq!(
            t["description"],
            "Stock of an item. Unavailable now: its service has no healthy instance."
        );
    }

    #[test]
    fn pages_cover_every_tool_once_and_refuse_foreign_cursors() {
        let tools: Vec<(String, Value)> = (0..250)
            .map(|i| (format!("svc__tool{i:04}"), json!({})))
            .collect();
        let l = Listing::of(None, tools);
        let mut seen = Vec::new();
        let mut cursor: Option<String> = None;
        let mut pages = 0;
        loop {
            let Page {
                tools: page,
                rendered,
                next,
            } = l.page(cursor.as_deref()).expect("page");
            assert!(page.len() <= PAGE_SIZE);
            assert_eq!(rendered.len(), page.len());
            for ((_, tool), raw) in page.iter().zip(rendered) {
                assert_eq!(
                    &serde_json::from_str::<Value>(raw.get()).expect("json"),
                    tool
                );
            }
            seen.extend(page.iter().map(|(n, _)| n.clone()));
            pages += 1;
            match next {
                Some(c) => cursor = Some(c),
                None => break,
            }
        }
        assert_eq!(pages, 3);
        let want: Vec<String> = l.tools.iter().map(|(n, _)| n.clone()).collect();
        assert_eq!(seen, want);
        for bad in ["", "abc", "tgc1.!!", "tgc1./w"] {
            assert_eq!(
                l.page(Some(bad)).err(),
                Some(BadCursor(bad.to_string())),
                "{bad}"
            );
        }
        let none = Listing::default();
        let empty = none.page(None).expect("empty");
        assert!(empty.tools.is_empty() && empty.next.is_none());
    }
}
