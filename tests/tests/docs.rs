//! The documentation as a user reads it: README.md and the book's pages (`docs/src/**/*.md`)
//! link only to files that exist and to headings those files have, and the admin API reference
//! (`docs/src/reference/admin-api.md`) documents every route toolgate-xds's admin listener
//! serves, read from the router in `xds-server/src`. No network and no mdBook: the slugs are
//! computed here the way mdBook and GitHub make them.

use std::collections::BTreeSet;
use std::path::{Component, Path, PathBuf};

fn root() -> PathBuf {
    toolgate_tests::paths::workspace_root()
}

/// Every file under `dir` whose name ends with `.{ext}`, sorted.
fn files(dir: &Path, ext: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        let entries =
            std::fs::read_dir(&d).unwrap_or_else(|e| panic!("reading {}: {e}", d.display()));
        for entry in entries {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == ext) {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

/// The book's pages, sorted.
pub(crate) fn book_pages() -> Vec<PathBuf> {
    files(&root().join("docs/src"), "md")
}

/// The lines of a markdown text outside fenced code blocks, with their numbers (from 1).
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut fence: Option<&str> = None;
    let mut lines = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        match fence {
            Some(f) => {
                if trimmed.starts_with(f) {
                    fence = None;
                }
            }
            None if trimmed.starts_with("```") => fence = Some("```"),
            None if trimmed.starts_with("~~~") => fence = Some("~~~"),
            None => lines.push((n + 1, line)),
        }
    }
    lines
}

/// `line` without its inline code spans (a link written in backticks is not a link).
fn without_code(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut in_code = false;
    for c in line.chars() {
        if c == '`' {
            in_code = !in_code;
        } else if !in_code {
            out.push(c);
        }
    }
    out
}

/// The text of a heading line (`## The fleet`), or `None` for any other line.
fn heading_text(line: &str) -> Option<&str> {
    let hashes = line.len() - line.trim_start_matches('#').len();
    if !(1..=6).contains(&hashes) {
        return None;
    }
    line[hashes..]
        .strip_prefix(' ')
        .map(|t| t.trim().trim_end_matches('#').trim_end())
}

/// The anchor mdBook (and GitHub) give a heading: its text without markup, lower-cased,
/// letters, digits, `_` and `-` kept, whitespace made `-`, everything else dropped.
fn slug(heading: &str) -> String {
    // Links keep their text: `[text](target)` -> `text`.
    let mut text = String::new();
    let mut rest = heading;
    while let Some(open) = rest.find('[') {
        text.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        match after.find("](").and_then(|close| {
            after[close + 2..]
                .find(')')
                .map(|end| (close, close + 2 + end + 1))
        }) {
            Some((close, end)) => {
                text.push_str(&after[..close]);
                rest = &after[end..];
            }
            None => {
                text.push('[');
                rest = after;
            }
        }
    }
    text.push_str(rest);
    text.chars()
        .filter_map(|c| {
            if c.is_alphanumeric() || c == '_' || c == '-' {
                Some(c.to_lowercase().next().unwrap_or(c))
            } else if c.is_whitespace() {
                Some('-')
            } else {
                None
            }
        })
        .collect()
}

/// Every anchor a markdown text's headings make; a repeated heading gets `-1`, `-2`, ...
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    for (_, line) in prose_lines(text) {
        let Some(heading) = heading_text(line) else {
            continue;
        };
        let base = slug(heading);
        let mut id = base.clone();
        let mut n = 0;
        while seen.contains(&id) {
            n += 1;
            id = format!("{base}-{n}");
        }
        seen.insert(id);
    }
    seen
}

/// The targets of the inline links and images on a line: `[text](target)`, `![alt](target)`.
fn link_targets(line: &str) -> Vec<String> {
    let line = without_code(line);
    let mut targets = Vec::new();
    let mut rest = line.as_str();
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        // The target ends at the parenthesis that closes the one opened.
        let mut depth = 0usize;
        let mut end = None;
        for (i, c) in after.char_indices() {
            match c {
                '(' => depth += 1,
                ')' if depth == 0 => {
                    end = Some(i);
                    break;
                }
                ')' => depth -= 1,
                _ => {}
            }
        }
        let Some(end) = end else { break };
        // A title may follow the target: `(path "title")`.
        let target = after[..end].split_whitespace().next().unwrap_or_default();
        let target = target
            .strip_prefix('<')
            .and_then(|t| t.strip_suffix('>'))
            .unwrap_or(target);
        targets.push(target.to_string());
        rest = &after[end..];
    }
    targets
}

/// `path` with `.` and `..` resolved, without touching the file system.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other.as_os_str()),
        }
    }
    out
}

/// What is wrong with the relative links of one page: each broken one, named with the page,
/// its line and why. `read` gives another file's text (to find its headings), or `None` when
/// the file does not exist.
fn broken_links(
    page: &Path,
    text: &str,
    exists: &dyn Fn(&Path) -> bool,
    read: &dyn Fn(&Path) -> Option<String>,
) -> Vec<String> {
    let mut problems = Vec::new();
    let dir = page.parent().unwrap_or(Path::new(""));
    for (n, line) in prose_lines(text) {
        for target in link_targets(line) {
            if target.is_empty()
                || target.contains("://")
                || target.starts_with("mailto:")
                || target.starts_with("//")
            {
                continue;
            }
            let (file, anchor) = match target.split_once('#') {
                Some((file, anchor)) => (file, Some(anchor)),
                None => (target.as_str(), None),
            };
            let at = format!("{}:{n}: ({target})", page.display());
            let (path, target_text) = if file.is_empty() {
                (page.to_path_buf(), Some(text.to_string()))
            } else {
                let path = normalize(&dir.join(file));
                if !exists(&path) {
                    problems.push(format!("{at}: no file {}", path.display()));
                    continue;
                }
                let target_text = anchor.and_then(|_| read(&path));
                (path, target_text)
            };
            let Some(anchor) = anchor else { continue };
            if path.extension().is_none_or(|e| e != "md") {
                problems.push(format!("{at}: an anchor into a file that is not markdown"));
                continue;
            }
            let headings = anchors(target_text.as_deref().unwrap_or_default());
            if !headings.contains(anchor) {
                problems.push(format!(
                    "{at}: {} has no heading #{anchor} (it has: {})",
                    path.display(),
                    headings.into_iter().collect::<Vec<_>>().join(", ")
                ));
            }
        }
    }
    problems
}

#[test]
fn every_relative_link_of_the_readme_and_the_book_leads_to_a_file_and_heading() {
    let root = root();
    let mut pages = vec![root.join("README.md")];
    pages.extend(book_pages());
    assert!(
        pages.len() > 20,
        "the book has its pages under docs/src: {pages:?}"
    );
    let exists = |p: &Path| p.exists();
    let read = |p: &Path| std::fs::read_to_string(p).ok();
    let mut problems = Vec::new();
    let mut links = 0;
    for page in &pages {
        let text = std::fs::read_to_string(page)
            .unwrap_or_else(|e| panic!("reading {}: {e}", page.display()));
        links += prose_lines(&text)
            .iter()
            .map(|(_, l)| link_targets(l).len())
            .sum::<usize>();
        let relative = page.strip_prefix(&root).unwrap_or(page);
        problems.extend(broken_links(
            relative,
            &text,
            &|p: &Path| exists(&root.join(p)),
            &|p: &Path| read(&root.join(p)),
        ));
    }
    println!("{} pages, {links} links", pages.len());
    assert!(
        problems.is_empty(),
        "broken links:\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_link_check_finds_a_missing_file_a_missing_heading_and_a_bad_anchor_in_the_same_page() {
    let page = Path::new("docs/src/tasks/page.md");
    let text = "# Page\n\n## Where `/mcp` goes\n\n\
                [fine](../concepts/fleet.md#the-fleet) and [here](#where-mcp-goes)\n\
                [gone](../concepts/gone.md)\n\
                [no such heading](../concepts/fleet.md#one-fleet)\n\
                [not here](#nowhere)\n\
                `[in code](nowhere.md)` and [outside](https://example.com/x.md)\n\
                ```\n[in a block](nowhere.md)\n```\n";
    let fleet = Path::new("docs/src/concepts/fleet.md");
    let exists = |p: &Path| p == fleet;
    let read = |p: &Path| (p == fleet).then(|| "# The fleet\n\nText.\n".to_string());
    let problems = broken_links(page, text, &exists, &read);
    assert_eq!(problems.len(), 3, "{problems:#?}");
    assert!(
        problems[0].contains(":6:") && problems[0].contains("no file docs/src/concepts/gone.md")
    );
    assert!(problems[1].contains(":7:") && problems[1].contains("no heading #one-fleet"));
    assert!(problems[2].contains(":8:") && problems[2].contains("no heading #nowhere"));
}

#[test]
fn slugs_are_mdbooks() {
    assert_eq!(slug("The one endpoint: `/mcp`"), "the-one-endpoint-mcp");
    assert_eq!(
        slug("Held sessions: who shares what"),
        "held-sessions-who-shares-what"
    );
    assert_eq!(slug("`GET /v1/registry`"), "get-v1registry");
    assert_eq!(slug("2026-07-28 clients"), "2026-07-28-clients");
    assert_eq!(slug("See [the fleet](fleet.md) now"), "see-the-fleet-now");
    let repeated = anchors("# A\n## Same\n## Same\n```\n# not a heading\n```\n");
    assert_eq!(
        repeated.into_iter().collect::<Vec<_>>(),
        ["a", "same", "same-1"]
    );
}

/// Every `.route("<path>", <methods>)` of toolgate-xds's admin router, as (method, path), the
/// path as the router writes it (`{param}` placeholders included). A path given by a constant
/// is looked up in `xds-server/src` and `model/src`.
fn admin_routes() -> BTreeSet<(String, String)> {
    let root = root();
    let mut sources = files(&root.join("xds-server/src"), "rs");
    sources.extend(files(&root.join("model/src"), "rs"));
    let texts: Vec<(PathBuf, String)> = sources
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p)
                .unwrap_or_else(|e| panic!("reading {}: {e}", p.display()));
            (p, text)
        })
        .collect();
    let constant = |name: &str| -> Option<String> {
        let decl = format!("const {name}: &str = \"");
        texts.iter().find_map(|(_, text)| {
            let at = text.find(&decl)? + decl.len();
            text[at..]
                .find('"')
                .map(|end| text[at..at + end].to_string())
        })
    };
    let mut routes = BTreeSet::new();
    for (path, text) in &texts {
        if !path.starts_with(root.join("xds-server/src")) {
            continue;
        }
        for (at, _) in text.match_indices(".route(") {
            let args_start = at + ".route(".len();
            // The call's arguments, to the parenthesis that closes it.
            let mut depth = 0usize;
            let mut end = text.len();
            for (i, c) in text[args_start..].char_indices() {
                match c {
                    '(' => depth += 1,
                    ')' if depth == 0 => {
                        end = args_start + i;
                        break;
                    }
                    ')' => depth -= 1,
                    _ => {}
                }
            }
            let args = text[args_start..end].trim_start();
            let (route, methods) = if let Some(quoted) = args.strip_prefix('"') {
                let close = quoted.find('"').expect("a closed string literal");
                (quoted[..close].to_string(), &quoted[close + 1..])
            } else {
                let ident_end = args
                    .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                    .unwrap_or(args.len());
                let ident = &args[..ident_end];
                let name = ident.rsplit("::").next().unwrap_or(ident);
                let value = constant(name).unwrap_or_else(|| {
                    panic!(
                        "{}: the route path {ident} is no `const {name}: &str` found in \
                         xds-server/src or model/src",
                        path.display()
                    )
                });
                (value, &args[ident_end..])
            };
            let mut any = false;
            for method in ["get", "post", "put", "delete", "patch"] {
                let call = format!("{method}(");
                let called = methods.match_indices(&call).any(|(i, _)| {
                    i == 0
                        || !methods[..i]
                            .chars()
                            .next_back()
                            .is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':')
                });
                if called {
                    routes.insert((method.to_uppercase(), route.clone()));
                    any = true;
                }
            }
            assert!(
                any,
                "{}: no method found for the route {route}",
                path.display()
            );
        }
    }
    routes
}

/// Whether `text` has `needle` where it is not part of a longer path (`/v1/auth` is not
/// documented by `/v1/auth/config`).
fn has_path(text: &str, needle: &str) -> bool {
    text.match_indices(needle).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after = text[at + needle.len()..].chars().next();
        !before.is_some_and(|c| c.is_alphanumeric() || "/_-{".contains(c))
            && !after.is_some_and(|c| c.is_alphanumeric() || "/_-{.".contains(c))
    })
}

#[test]
fn the_admin_api_reference_documents_every_route_of_the_admin_router() {
    let routes = admin_routes();
    println!("admin routes: {routes:?}");
    for (method, path) in [
        ("GET", "/healthz"),
        ("GET", "/metrics"),
        ("GET", "/v1/registry"),
        ("PUT", "/v1/overrides/{service}/{tool}"),
        ("POST", "/v1/filter-config-status"),
        ("DELETE", "/v1/upstream-sessions/{owner}"),
        ("GET", "/ui/"),
    ] {
        assert!(
            routes.contains(&(method.to_string(), path.to_string())),
            "the router's routes were read: {method} {path} missing from {routes:?}"
        );
    }
    let page = root().join("docs/src/reference/admin-api.md");
    let text = std::fs::read_to_string(&page).expect("docs/src/reference/admin-api.md");
    let headings: Vec<String> = prose_lines(&text)
        .into_iter()
        .filter_map(|(_, l)| heading_text(l).map(str::to_string))
        .collect();
    let mut missing = Vec::new();
    for (method, path) in &routes {
        // Each route has a section: a heading naming the method and the path, `GET /v1/registry`.
        let documented = headings
            .iter()
            .any(|h| has_path(h, &format!("{method} {path}")));
        if !documented {
            missing.push(format!("{method} {path}"));
        }
    }
    assert!(
        missing.is_empty(),
        "docs/src/reference/admin-api.md has no section (a heading `METHOD path`) for:\n{}",
        missing.join("\n")
    );
}
