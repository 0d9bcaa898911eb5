//! Listing a server's tools (`tools/list`, every page) and sorting the names toolgate can
//! register from those it must refuse, each with its reason.

use std::collections::BTreeSet;

use serde_json::{json, Value};
use toolgate_model::validate_name;

use super::{Failure, McpClient};

/// Bounds on what one listing may cost; a server past them gets the tools read so far and a
/// note saying where it was cut.
#[derive(Debug, Clone, Copy)]
pub struct ListLimits {
    pub max_pages: usize,
    pub max_tools: usize,
}

impl Default for ListLimits {
    fn default() -> Self {
        ListLimits {
            max_pages: 100,
            // An etcd value holds 1.5 MiB; 2,000 names of 128 characters stay well inside.
            max_tools: 2_000,
        }
    }
}

/// A tool the registrar cannot register, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Refused {
    pub name: String,
    pub why: String,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Listing {
    /// Registrable names, in the server's order, each once.
    pub names: Vec<String>,
    /// The full definitions (description, inputSchema, outputSchema, annotations…) of
    /// `names`, in the same order, as the server gave them.
    pub definitions: Vec<Value>,
    pub refused: Vec<Refused>,
    /// Where and why the listing stopped before the server's last page.
    pub cut: Option<String>,
    pub pages: usize,
}

impl McpClient {
    /// Every page of `tools/list`, following `nextCursor`.
    pub async fn list_tools(&mut self, limits: ListLimits) -> Result<Listing, Failure> {
        let mut listing = Listing::default();
        let mut seen = BTreeSet::new();
        let mut cursors = BTreeSet::new();
        let mut cursor: Option<String> = None;
        loop {
            if listing.pages == limits.max_pages {
                listing.cut = Some(format!(
                    "stopped after {} pages; the server offered more",
                    limits.max_pages
                ));
                break;
            }
            let params = match &cursor {
                Some(c) => json!({ "cursor": c }),
                None => json!({}),
            };
            let result = self.request("tools/list", params).await?;
            listing.pages += 1;
            let Some(tools) = result.get("tools").and_then(Value::as_array) else {
                return Err(Failure::Malformed {
                    request: "tools/list".into(),
                    why: format!("page {} has no \"tools\" array", listing.pages),
                });
            };
            for (i, tool) in tools.iter().enumerate() {
                if listing.names.len() == limits.max_tools {
                    listing.cut = Some(format!(
                        "stopped at {} tools; the server lists more",
                        limits.max_tools
                    ));
                    return Ok(listing);
                }
                sort_tool(tool, listing.pages, i, &mut seen, &mut listing);
            }
            match result.get("nextCursor") {
                None | Some(Value::Null) => break,
                Some(Value::String(next)) => {
                    if !cursors.insert(next.clone()) {
                        listing.cut = Some(format!(
                            "the server returned cursor {next:?} twice; stopped there"
                        ));
                        break;
                    }
                    cursor = Some(next.clone());
                }
                Some(other) => {
                    listing.cut = Some(format!(
                        "page {} has a nextCursor that is not a string ({other}); stopped there",
                        listing.pages
                    ));
                    break;
                }
            }
        }
        Ok(listing)
    }
}

fn sort_tool(
    tool: &Value,
    page: usize,
    index: usize,
    seen: &mut BTreeSet<String>,
    listing: &mut Listing,
) {
    let Some(name) = tool.get("name").and_then(Value::as_str) else {
        listing.refused.push(Refused {
            name: format!("(page {page}, entry {index})"),
            why: "has no string \"name\"".into(),
        });
        return;
    };
    if let Err(e) = validate_name("tool", name) {
        listing.refused.push(Refused {
            name: shorten(name),
            why: e.to_string(),
        });
        return;
    }
    if !seen.insert(name.to_string()) {
        listing.refused.push(Refused {
            name: name.to_string(),
            why: "listed more than once; registered once".into(),
        });
        return;
    }
    listing.names.push(name.to_string());
    listing.definitions.push(tool.clone());
}

fn shorten(name: &str) -> String {
    if name.chars().count() > 64 {
        format!("{}…", name.chars().take(64).collect::<String>())
    } else {
        name.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_names_and_duplicates_are_refused_with_a_reason() {
        let mut listing = Listing::default();
        let mut seen = BTreeSet::new();
        for (i, t) in [
            json!({"name": "ok_tool"}),
            json!({"name": "has space"}),
            json!({"name": ""}),
            json!({"name": "x".repeat(300)}),
            json!({"title": "no name"}),
            json!({"name": "ok_tool"}),
            json!({"name": 5}),
        ]
        .iter()
        .enumerate()
        {
            sort_tool(t, 1, i, &mut seen, &mut listing);
        }
        assert_eq!(listing.names, ["ok_tool"]);
        assert_eq!(listing.definitions, [json!({"name": "ok_tool"})]);
        assert_eq!(listing.refused.len(), 6, "{:?}", listing.refused);
        assert!(listing.refused[0].why.contains("contains ' '"));
        assert!(listing.refused[2].name.ends_with('…'));
        assert!(listing.refused[4].why.contains("more than once"));
    }
}
