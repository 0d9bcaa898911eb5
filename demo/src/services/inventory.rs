//! `inventory`: stock counts from a small in-memory table, read either "from
//! the database" (a few milliseconds of simulated latency) or "from the cache"
//! (instant, possibly stale). Two tools with different speed so a gateway's
//! slow-call handling and fallback tools have something to work on.

use std::{sync::Arc, time::Duration};

use rmcp::{
    handler::server::wrapper::Parameters, model::CallToolResult, schemars, tool, tool_handler,
    tool_router, ServerHandler,
};
use serde::Deserialize;
use serde_json::json;

use super::{answer, refuse};

/// SKU and units in stock.
const STOCK: &[(&str, u64)] = &[
    ("WIDGET-1", 42),
    ("WIDGET-2", 0),
    ("GADGET-7", 318),
    ("SPROCKET-3", 1250),
    ("BOLT-M8", 9800),
    ("GASKET-XL", 7),
];

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct SkuQuery {
    /// Stock keeping unit, e.g. "WIDGET-1" (case-insensitive).
    pub sku: String,
}

#[derive(Clone, Copy, Debug)]
enum Source {
    Database,
    Cache,
}

impl Source {
    fn name(self) -> &'static str {
        match self {
            Source::Database => "database",
            Source::Cache => "cache",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Inventory {
    instance_id: Arc<str>,
}

impl Inventory {
    pub fn new(instance_id: Arc<str>) -> Self {
        Self { instance_id }
    }

    fn lookup(&self, sku: &str, source: Source) -> CallToolResult {
        let wanted = sku.trim().to_ascii_uppercase();
        let instance_id = &*self.instance_id;
        match STOCK.iter().find(|(known, _)| *known == wanted) {
            Some((known, in_stock)) => {
                let note = match source {
                    Source::Database => "live from the inventory database",
                    Source::Cache => "cached, may be a few minutes stale",
                };
                answer(
                    format!("{known}: {in_stock} in stock ({note}; instance {instance_id})"),
                    json!({
                        "sku": known,
                        "in_stock": in_stock,
                        "source": source.name(),
                        "cached": matches!(source, Source::Cache),
                        "instance_id": instance_id,
                    }),
                )
            }
            None => refuse(
                format!("unknown SKU '{sku}' (instance {instance_id})"),
                json!({
                    "sku": sku,
                    "error": "unknown_sku",
                    "source": source.name(),
                    "instance_id": instance_id,
                }),
            ),
        }
    }
}

/// What a round trip to a real database would cost.
fn simulated_db_latency() -> Duration {
    Duration::from_millis(rand::random_range(5..=20))
}

#[tool_router]
impl Inventory {
    #[tool(
        description = "Stock count of a SKU, read live from the inventory database (takes a few milliseconds).",
        annotations(read_only_hint = true)
    )]
    async fn query_inventory_db(
        &self,
        Parameters(SkuQuery { sku }): Parameters<SkuQuery>,
    ) -> CallToolResult {
        tokio::time::sleep(simulated_db_latency()).await;
        self.lookup(&sku, Source::Database)
    }

    #[tool(
        description = "Stock count of a SKU from the cache: instant, but may be a few minutes stale.",
        annotations(read_only_hint = true)
    )]
    async fn query_cached_inventory(
        &self,
        Parameters(SkuQuery { sku }): Parameters<SkuQuery>,
    ) -> CallToolResult {
        self.lookup(&sku, Source::Cache)
    }
}

#[tool_handler(
    name = "toolgate-inventory",
    instructions = "Inventory lookups. Prefer query_inventory_db; query_cached_inventory is the fallback when the database is slow."
)]
impl ServerHandler for Inventory {}

#[cfg(test)]
mod tests {
    use super::*;

    fn inventory() -> Inventory {
        Inventory::new(Arc::from("inv-test"))
    }

    #[test]
    fn known_sku_reports_stock_and_instance() {
        let result = inventory().lookup("widget-1", Source::Database);
        assert_eq!(result.is_error, Some(false));
        let structured = result.structured_content.unwrap_or_default();
        assert_eq!(structured["in_stock"], 42);
        assert_eq!(structured["instance_id"], "inv-test");
    }

    #[test]
    fn unknown_sku_is_a_tool_error() {
        let result = inventory().lookup("NOPE-0", Source::Cache);
        assert_eq!(result.is_error, Some(true));
    }
}
