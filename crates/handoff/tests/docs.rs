//! The project's docs name only what exists (issue 33 item 5): every file
//! a doc names in backticks is in the repository, every type (or
//! `Type::member`) ARCHITECTURE.md and DESIGN.md name is defined in the
//! source, and nothing cites numbered sections of a design brief that a
//! clone does not have.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

const DOCS: &[&str] = &[
    "README.md",
    "ARCHITECTURE.md",
    "DESIGN.md",
    "TESTING.md",
    "BENCHMARKS.md",
];

/// Names the docs mention as absent on purpose, with why.
const ABSENT_ON_PURPOSE: &[(&str, &str)] = &[
    (
        "pip.py",
        "the hostile file a test plants in the caller's directory",
    ),
    ("ShmRegion::with_mut", "DESIGN.md records that it is gone"),
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every file under the repository's root but build output, models,
/// caches and hidden directories, as paths relative to the root.
fn tree() -> Vec<String> {
    fn walk(dir: &Path, rel: &str, out: &mut Vec<String>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.')
                || ["target", "models", "node_modules"].contains(&name.as_str())
            {
                continue;
            }
            let path = if rel.is_empty() {
                name.clone()
            } else {
                format!("{rel}/{name}")
            };
            match e.file_type() {
                Ok(t) if t.is_dir() => walk(&e.path(), &path, out),
                Ok(_) => out.push(path),
                Err(_) => {}
            }
        }
    }
    let mut out = Vec::new();
    walk(&root(), "", &mut out);
    out
}

/// The backticked spans of `text` (single backticks, one line).
fn spans(text: &str) -> Vec<&str> {
    text.lines()
        .flat_map(|l| l.split('`').skip(1).step_by(2))
        .map(str::trim)
        .collect()
}

fn is_file_name(s: &str) -> bool {
    let exts = [".rs", ".sh", ".py", ".md", ".toml", ".yaml", ".yml"];
    exts.iter().any(|e| s.ends_with(e))
        && s.len() > 3
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_./-".contains(&b))
}

/// `Type` or `Type::member`: a capitalised Rust identifier, maybe a path.
fn type_name(s: &str) -> Option<Vec<&str>> {
    let parts: Vec<&str> = s.split("::").collect();
    let ident = |p: &str| {
        !p.is_empty()
            && p.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
            && !p.as_bytes()[0].is_ascii_digit()
    };
    let first = parts[0];
    let capital = first.as_bytes().first().is_some_and(u8::is_ascii_uppercase)
        && first.bytes().any(|b| b.is_ascii_lowercase());
    (parts.len() <= 2 && capital && parts.iter().all(|p| ident(p))).then_some(parts)
}

#[test]
fn docs_name_only_files_and_types_that_exist() {
    let files = tree();
    let set: HashSet<&str> = files.iter().map(String::as_str).collect();
    let base = |f: &str| f.rsplit('/').next().unwrap_or(f).to_string();
    let bases: HashSet<String> = files.iter().map(|f| base(f)).collect();
    let rust: String = files
        .iter()
        .filter(|f| f.ends_with(".rs"))
        .filter_map(|f| std::fs::read_to_string(root().join(f)).ok())
        .collect::<Vec<_>>()
        .join("\n");
    let words: HashSet<&str> = rust
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
        .collect();
    let absent: HashSet<&str> = ABSENT_ON_PURPOSE.iter().map(|(n, _)| *n).collect();
    let mut missing = Vec::new();
    for doc in DOCS {
        let text = std::fs::read_to_string(root().join(doc)).expect("doc");
        for s in spans(&text) {
            if absent.contains(s) {
                continue;
            }
            if is_file_name(s) {
                let found = set.contains(s)
                    || (!s.contains('/') && bases.contains(s))
                    || files.iter().any(|f| f.ends_with(&format!("/{s}")));
                if !found {
                    missing.push(format!("{doc}: file `{s}`"));
                }
            } else if ["ARCHITECTURE.md", "DESIGN.md"].contains(doc) {
                if let Some(parts) = type_name(s) {
                    if let Some(p) = parts.iter().find(|p| !words.contains(**p)) {
                        missing.push(format!("{doc}: `{s}` ({p} is in no source file)"));
                    }
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "docs name what does not exist:\n{}",
        missing.join("\n")
    );
    // The check itself finds what it should.
    assert!(is_file_name("crates/handoff-engine/src/fair.rs") && !is_file_name("a b.rs"));
    assert_eq!(
        type_name("Turnstile::turn"),
        Some(vec!["Turnstile", "turn"])
    );
    assert_eq!(type_name("PD"), None);
}

#[test]
fn nothing_cites_sections_of_a_brief_outside_the_repository() {
    let brief = ["DESIGN.md", " §"].concat();
    let mut cites = Vec::new();
    for f in tree() {
        let text_file = [".rs", ".md", ".sh", ".py", ".toml", ".yaml"]
            .iter()
            .any(|e| f.ends_with(e));
        if !text_file {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(root().join(&f)) else {
            continue;
        };
        for (i, line) in text.lines().enumerate() {
            if line.contains(&brief) {
                cites.push(format!("{f}:{}: {}", i + 1, line.trim()));
            }
        }
    }
    assert!(
        cites.is_empty(),
        "DESIGN.md here has no numbered sections (they were the brief's):\n{}",
        cites.join("\n")
    );
}
