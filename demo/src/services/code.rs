//! `code`: a quick structural summary of a piece of source code: token
//! counts by kind and whether its brackets balance. Not a real parser; it is
//! language-agnostic on purpose (C-like comments and double-quoted strings).

use std::sync::Arc;

use rmcp::{
    handler::server::wrapper::Parameters, model::CallToolResult, schemars, tool, tool_handler,
    tool_router, ServerHandler,
};
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::answer;

#[derive(Debug, Deserialize, schemars::JsonSchema)]
pub struct ParseRequest {
    /// The source code to summarize.
    pub source: String,
}

#[derive(Debug, Default, PartialEq, Eq, Serialize)]
pub struct Summary {
    pub lines: usize,
    pub tokens: usize,
    pub identifiers: usize,
    pub numbers: usize,
    pub strings: usize,
    pub comments: usize,
    pub punctuation: usize,
    pub max_depth: usize,
    pub balanced: bool,
    /// The first bracket problem, with its 1-based line:column.
    pub problem: Option<String>,
}

struct Position {
    line: usize,
    column: usize,
}

/// Summarizes `source`. Brackets inside strings and comments do not count.
pub fn summarize(source: &str) -> Summary {
    let mut summary = Summary {
        lines: source.lines().count(),
        ..Summary::default()
    };
    let mut open: Vec<(char, Position)> = Vec::new();
    let mut chars = source.chars().peekable();
    let (mut line, mut column) = (1, 0);
    // Advances one character, keeping line:column current.
    let mut next = |chars: &mut std::iter::Peekable<std::str::Chars<'_>>| {
        let c = chars.next()?;
        if c == '\n' {
            line += 1;
            column = 0;
        } else {
            column += 1;
        }
        Some((c, Position { line, column }))
    };

    while let Some((c, at)) = next(&mut chars) {
        match c {
            c if c.is_whitespace() => {}
            '/' if chars.peek() == Some(&'/') => {
                summary.comments += 1;
                while chars.peek().is_some_and(|&c| c != '\n') {
                    next(&mut chars);
                }
            }
            '/' if chars.peek() == Some(&'*') => {
                summary.comments += 1;
                next(&mut chars);
                let mut previous = ' ';
                while let Some((c, _)) = next(&mut chars) {
                    if previous == '*' && c == '/' {
                        break;
                    }
                    previous = c;
                }
            }
            '"' => {
                summary.strings += 1;
                summary.tokens += 1;
                while let Some((c, _)) = next(&mut chars) {
                    match c {
                        '\\' => {
                            next(&mut chars);
                        }
                        '"' => break,
                        _ => {}
                    }
                }
            }
            c if c.is_alphabetic() || c == '_' => {
                summary.identifiers += 1;
                summary.tokens += 1;
                while chars
                    .peek()
                    .is_some_and(|&c| c.is_alphanumeric() || c == '_')
                {
                    next(&mut chars);
                }
            }
            c if c.is_ascii_digit() => {
                summary.numbers += 1;
                summary.tokens += 1;
                while chars
                    .peek()
                    .is_some_and(|&c| c.is_alphanumeric() || c == '_' || c == '.')
                {
                    next(&mut chars);
                }
            }
            '(' | '[' | '{' => {
                summary.punctuation += 1;
                summary.tokens += 1;
                open.push((c, at));
                summary.max_depth = summary.max_depth.max(open.len());
            }
            ')' | ']' | '}' => {
                summary.punctuation += 1;
                summary.tokens += 1;
                let expected = match c {
                    ')' => '(',
                    ']' => '[',
                    _ => '{',
                };
                match open.pop() {
                    Some((opener, _)) if opener == expected => {}
                    Some((opener, opened)) => {
                        summary.problem.get_or_insert(format!(
                            "'{c}' at {}:{} closes '{opener}' opened at {}:{}",
                            at.line, at.column, opened.line, opened.column
                        ));
                    }
                    None => {
                        summary.problem.get_or_insert(format!(
                            "'{c}' at {}:{} closes nothing",
                            at.line, at.column
                        ));
                    }
                }
            }
            _ => {
                summary.punctuation += 1;
                summary.tokens += 1;
            }
        }
    }
    if let Some((opener, opened)) = open.last() {
        summary.problem.get_or_insert(format!(
            "'{opener}' opened at {}:{} is never closed",
            opened.line, opened.column
        ));
    }
    summary.balanced = summary.problem.is_none();
    summary
}

#[derive(Clone, Debug)]
pub struct Code {
    instance_id: Arc<str>,
}

impl Code {
    pub fn new(instance_id: Arc<str>) -> Self {
        Self { instance_id }
    }
}

#[tool_router]
impl Code {
    #[tool(
        description = "Summarize source code: token counts by kind, nesting depth, and whether brackets balance.",
        annotations(read_only_hint = true)
    )]
    async fn ast_parse(
        &self,
        Parameters(ParseRequest { source }): Parameters<ParseRequest>,
    ) -> CallToolResult {
        let summary = summarize(&source);
        let instance_id = &*self.instance_id;
        let brackets = match &summary.problem {
            None => format!("brackets balanced, max depth {}", summary.max_depth),
            Some(problem) => format!("brackets unbalanced: {problem}"),
        };
        let text = format!(
            "{} tokens on {} lines ({} identifiers, {} numbers, {} strings, {} punctuation, {} comments); {brackets} (instance {instance_id})",
            summary.tokens,
            summary.lines,
            summary.identifiers,
            summary.numbers,
            summary.strings,
            summary.punctuation,
            summary.comments,
        );
        let mut structured = json!(summary);
        structured["instance_id"] = json!(instance_id);
        answer(text, structured)
    }
}

#[tool_handler(name = "toolgate-code", instructions = "Source code analysis.")]
impl ServerHandler for Code {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_tokens_by_kind() {
        let summary = summarize("fn main() {\n    let x = 42; // answer\n    print(\"a(b\");\n}\n");
        assert_eq!(summary.lines, 4);
        assert_eq!(summary.identifiers, 5);
        assert_eq!(summary.numbers, 1);
        assert_eq!(summary.strings, 1);
        assert_eq!(summary.comments, 1);
        assert_eq!(summary.max_depth, 2);
        assert!(summary.balanced, "{:?}", summary.problem);
    }

    #[test]
    fn reports_a_mismatched_closer_with_its_position() {
        let summary = summarize("f(a[1)]");
        assert!(!summary.balanced);
        assert_eq!(
            summary.problem.as_deref(),
            Some("')' at 1:6 closes '[' opened at 1:4")
        );
    }

    #[test]
    fn reports_an_unclosed_opener() {
        let summary = summarize("{\n  (\n}");
        assert!(!summary.balanced);
        assert_eq!(
            summary.problem.as_deref(),
            Some("'}' at 3:1 closes '(' opened at 2:3")
        );
        let summary = summarize("call(");
        assert_eq!(
            summary.problem.as_deref(),
            Some("'(' opened at 1:5 is never closed")
        );
    }

    #[test]
    fn reports_a_stray_closer() {
        assert_eq!(
            summarize("x)").problem.as_deref(),
            Some("')' at 1:2 closes nothing")
        );
    }

    #[test]
    fn brackets_in_comments_and_strings_do_not_count() {
        let summary = summarize("/* ( */ \"[\" // {\n");
        assert!(summary.balanced);
        assert_eq!(summary.max_depth, 0);
    }
}
