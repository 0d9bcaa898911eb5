//! `finance`: sales tax from a small rate table.

use std::sync::Arc;

use rmcp::{
    handler::server::wrapper::Parameters, model::CallToolResult, schemars, tool, tool_handler,
    tool_router, ServerHandler,
};
use serde::Deserialize;
use serde_json::json;

use super::{answer, refuse};

/// Region code and tax rate.
const RATES: &[(&str, f64)] = &[
    ("us-ca", 0.0725),
    ("us-ny", 0.04),
    ("us-tx", 0.0625),
    ("de", 0.19),
    ("fr", 0.20),
    ("uk", 0.20),
    ("jp", 0.10),
];

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct TaxRequest {
    /// Net amount, in the region's currency.
    pub amount: f64,
    /// Region code, e.g. "us-ca", "de" (case-insensitive).
    pub region: String,
}

#[derive(Clone, Debug)]
pub struct Finance {
    instance_id: Arc<str>,
}

impl Finance {
    pub fn new(instance_id: Arc<str>) -> Self {
        Self { instance_id }
    }

    fn tax(&self, amount: f64, region: &str) -> CallToolResult {
        let instance_id = &*self.instance_id;
        if !amount.is_finite() || amount < 0.0 {
            return refuse(
                format!(
                    "amount must be a non-negative number, got {amount} (instance {instance_id})"
                ),
                json!({"error": "invalid_amount", "instance_id": instance_id}),
            );
        }
        let wanted = region.trim().to_ascii_lowercase();
        let Some((code, rate)) = RATES.iter().find(|(code, _)| *code == wanted) else {
            let known: Vec<&str> = RATES.iter().map(|(code, _)| *code).collect();
            return refuse(
                format!(
                    "unknown region '{region}'; known regions: {} (instance {instance_id})",
                    known.join(", ")
                ),
                json!({
                    "error": "unknown_region",
                    "region": region,
                    "known_regions": known,
                    "instance_id": instance_id,
                }),
            );
        };
        let tax = cents(amount * rate);
        let total = cents(amount + tax);
        answer(
            format!(
                "tax on {amount:.2} in {code} at {:.2}%: {tax:.2}, total {total:.2} (instance {instance_id})",
                rate * 100.0
            ),
            json!({
                "amount": amount,
                "region": code,
                "rate": rate,
                "tax": tax,
                "total": total,
                "instance_id": instance_id,
            }),
        )
    }
}

fn cents(value: f64) -> f64 {
    (value * 100.0).round() / 100.0
}

#[tool_router]
impl Finance {
    #[tool(
        description = "Sales tax on an amount for a region (us-ca, us-ny, us-tx, de, fr, uk, jp).",
        annotations(read_only_hint = true)
    )]
    async fn tax_calc(
        &self,
        Parameters(TaxRequest { amount, region }): Parameters<TaxRequest>,
    ) -> CallToolResult {
        self.tax(amount, &region)
    }
}

#[tool_handler(name = "toolgate-finance", instructions = "Sales tax calculations.")]
impl ServerHandler for Finance {}

#[cfg(test)]
mod tests {
    use super::*;

    fn finance() -> Finance {
        Finance::new(Arc::from("fin-test"))
    }

    #[test]
    fn tax_uses_the_region_rate_rounded_to_cents() {
        let result = finance().tax(100.0, "DE");
        assert_eq!(result.is_error, Some(false));
        let structured = result.structured_content.unwrap_or_default();
        assert_eq!(structured["tax"], 19.0);
        assert_eq!(structured["total"], 119.0);
        assert_eq!(structured["instance_id"], "fin-test");
    }

    #[test]
    fn unknown_region_is_a_tool_error_naming_it() {
        let result = finance().tax(10.0, "mars");
        assert_eq!(result.is_error, Some(true));
        let text = result.content[0].as_text().map(|t| t.text.clone());
        assert!(text.unwrap_or_default().contains("'mars'"));
    }

    #[test]
    fn negative_amount_is_a_tool_error() {
        assert_eq!(finance().tax(-1.0, "de").is_error, Some(true));
    }
}
