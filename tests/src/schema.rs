//! The official MCP JSON schemas (`../shared/mcp-schema/<version>.schema.json`), for checking
//! what an agent actually receives.

use jsonschema::Validator;
use serde_json::{json, Value};

use crate::paths::workspace_root;

/// A validator for one definition (`JSONRPCMessage`, `CallToolResult`, …) of one protocol
/// version's schema.
pub fn validator(version: &str, definition: &str) -> Validator {
    let path = workspace_root()
        .join("../shared/mcp-schema")
        .join(format!("{version}.schema.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let file: Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    // draft-07 files keep `definitions`, 2020-12 files `$defs`.
    let defs = if file.get("$defs").is_some() {
        "$defs"
    } else {
        "definitions"
    };
    assert!(
        file[defs].get(definition).is_some(),
        "{version} has no definition {definition}"
    );
    let root = json!({
        "$schema": file["$schema"],
        defs: file[defs],
        // allOf, not a bare root $ref: draft-07 ignores a $ref's siblings.
        "allOf": [{"$ref": format!("#/{defs}/{definition}")}],
    });
    jsonschema::validator_for(&root).unwrap_or_else(|e| panic!("{version} {definition}: {e}"))
}

/// Panics listing every violation of `instance` against `definition` of `version`.
pub fn assert_valid(version: &str, definition: &str, instance: &Value) {
    let v = validator(version, definition);
    let errors: Vec<String> = v
        .iter_errors(instance)
        .map(|e| format!("{e} at {}", e.instance_path()))
        .collect();
    assert!(
        errors.is_empty(),
        "{version} {definition} rejects {instance}:\n{}",
        errors.join("\n")
    );
}
