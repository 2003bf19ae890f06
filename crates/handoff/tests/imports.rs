//! No import circle inside any crate (issue 33 item 4): within each crate
//! of the workspace, the modules that name one another's items form no
//! cycle, so every crate reads bottom-up.
//!
//! A module *names* another when its code (not comments, not its
//! `#[cfg(test)]` modules, not a `tests.rs` file) has a path starting with
//! `crate::`, `super::` or `self::` that reaches that module's items; a
//! path through a `pub use` re-export counts as naming the module the item
//! is defined in. A module's own `mod` declarations and relative paths to
//! its children (`pub use child::Item`) are how Rust declares a tree, not
//! imports, and do not count.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

type Module = Vec<String>;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every module file of `src` (a crate's `src/`) and its source; binaries
/// and `tests.rs` files left out.
fn crate_modules(src: &Path) -> BTreeMap<Module, String> {
    fn walk(dir: &Path, rel: &[String], out: &mut BTreeMap<Module, String>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let path = e.path();
            if path.is_dir() {
                if rel.is_empty() && name == "bin" {
                    continue;
                }
                let mut r = rel.to_vec();
                r.push(name);
                walk(&path, &r, out);
            } else if let Some(stem) = name.strip_suffix(".rs") {
                let mut m = rel.to_vec();
                if !["mod", "lib", "main"].contains(&stem) {
                    m.push(stem.to_string());
                }
                if m.last().is_some_and(|l| l == "tests") {
                    continue;
                }
                out.insert(m, std::fs::read_to_string(&path).unwrap());
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(src, &[], &mut out);
    out
}

/// `text` without comment lines and without `#[cfg(test)] mod x { .. }`
/// blocks.
fn code(text: &str) -> String {
    let text: String = text
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = String::new();
    let mut rest = text.as_str();
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let after = &rest[at + "#[cfg(test)]".len()..];
        let head = after.trim_start();
        let is_mod = ["mod ", "pub mod ", "pub(crate) mod "]
            .iter()
            .any(|p| head.starts_with(p))
            && head
                .find('{')
                .is_some_and(|b| head.find(';').is_none_or(|s| b < s));
        if !is_mod {
            out.push_str("#[cfg(test)]");
            rest = after;
            continue;
        }
        let open = after.find('{').unwrap();
        let mut depth = 0usize;
        let mut end = after.len();
        for (i, c) in after[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + i + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

/// The leaf paths of one `use` tree: `a::{b, c::{d}}` gives `a::b` and
/// `a::c::d` (aliases dropped).
fn expand(tree: &str) -> Vec<String> {
    let tree = tree.trim();
    let Some(open) = tree.find('{') else {
        let path = tree.split(" as ").next().unwrap_or(tree);
        return vec![path.split_whitespace().collect()];
    };
    let base: String = tree[..open].split_whitespace().collect();
    let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (i, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&inner[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&inner[start..]);
    parts
        .into_iter()
        .filter(|p| !p.trim().is_empty())
        .flat_map(|p| expand(p).into_iter().map(|leaf| format!("{base}{leaf}")))
        .collect()
}

/// Each `use` statement's leaf paths, with whether the statement is a
/// re-export (`pub use`, `pub(crate) use`, ...).
fn uses(code: &str) -> Vec<(bool, String)> {
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    let mut from = 0;
    while let Some(at) = code[from..].find("use ") {
        let at = from + at;
        from = at + 4;
        if at > 0 && (bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_') {
            continue;
        }
        let Some(end) = code[at..].find(';') else {
            break;
        };
        let tree = &code[at + 4..at + end];
        // A word "use" in a string or a macro is not a statement.
        if !tree
            .chars()
            .all(|c| c.is_alphanumeric() || "_:{},* \n\r\t".contains(c))
        {
            continue;
        }
        let line_start = code[..at].rfind('\n').map_or(0, |i| i + 1);
        let public = code[line_start..at].trim_start().starts_with("pub");
        for p in expand(tree) {
            out.push((public, p));
        }
        from = at + end;
    }
    out
}

/// Paths written inline (`crate::a::f(..)`), besides `use` statements.
fn inline_paths(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    for start in ["crate::", "super::", "self::"] {
        let mut from = 0;
        while let Some(at) = code[from..].find(start) {
            let at = from + at;
            let prev = code[..at].chars().next_back();
            from = at + start.len();
            if prev.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            let len = code[at..]
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(code.len() - at);
            out.push(code[at..at + len].trim_end_matches(':').to_string());
        }
    }
    out
}

struct Crate {
    modules: BTreeMap<Module, String>,
    /// (module, name) re-exported there → the path it re-exports.
    reexports: HashMap<(Module, String), String>,
}

impl Crate {
    fn new(modules: BTreeMap<Module, String>) -> Self {
        let modules: BTreeMap<Module, String> =
            modules.into_iter().map(|(m, t)| (m, code(&t))).collect();
        let mut reexports = HashMap::new();
        for (m, text) in &modules {
            for (public, path) in uses(text) {
                if !public {
                    continue;
                }
                let Some((base, name)) = path.rsplit_once("::") else {
                    continue;
                };
                let base = if ["crate", "super", "self"]
                    .iter()
                    .any(|s| base == *s || base.starts_with(&format!("{s}::")))
                {
                    base.to_string()
                } else {
                    format!("self::{base}")
                };
                reexports.insert((m.clone(), name.to_string()), base);
            }
        }
        Self { modules, reexports }
    }

    /// The module whose item `path`, written in `from`, names; `None` for
    /// a path outside the crate.
    fn resolve(&self, from: &Module, path: &str, depth: usize) -> Option<Module> {
        let mut segs = path.split("::").peekable();
        let mut cur: Module = match *segs.peek()? {
            "crate" => Vec::new(),
            "super" | "self" => from.clone(),
            _ => return None,
        };
        while let Some(&s) = segs.peek() {
            match s {
                "crate" => {}
                "self" => {}
                "super" => {
                    cur.pop();
                }
                _ => break,
            }
            segs.next();
        }
        let rest: Vec<&str> = segs.collect();
        let mut k = 0;
        for s in &rest {
            let mut next = cur.clone();
            next.push(s.to_string());
            if self.modules.contains_key(&next) {
                cur = next;
                k += 1;
            } else {
                break;
            }
        }
        if let Some(name) = rest.get(k) {
            if let Some(target) = self.reexports.get(&(cur.clone(), name.to_string())) {
                if depth < 8 {
                    if let Some(m) = self.resolve(&cur, target, depth + 1) {
                        return Some(m);
                    }
                }
            }
        }
        Some(cur)
    }

    /// Module → the other modules it names.
    fn graph(&self) -> BTreeMap<Module, BTreeSet<Module>> {
        let mut g = BTreeMap::new();
        for (m, text) in &self.modules {
            let mut to = BTreeSet::new();
            let paths = uses(text)
                .into_iter()
                .map(|(_, p)| p)
                .chain(inline_paths(text));
            for p in paths {
                if let Some(t) = self.resolve(m, &p, 0) {
                    if &t != m {
                        to.insert(t);
                    }
                }
            }
            g.insert(m.clone(), to);
        }
        g
    }
}

/// The strongly connected components of more than one module (Tarjan).
fn circles(g: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<Vec<Module>> {
    struct S<'a> {
        g: &'a BTreeMap<Module, BTreeSet<Module>>,
        index: HashMap<&'a Module, usize>,
        low: HashMap<&'a Module, usize>,
        stack: Vec<&'a Module>,
        on: BTreeSet<&'a Module>,
        out: Vec<Vec<Module>>,
    }
    fn visit<'a>(s: &mut S<'a>, v: &'a Module) {
        let i = s.index.len();
        s.index.insert(v, i);
        s.low.insert(v, i);
        s.stack.push(v);
        s.on.insert(v);
        for w in s.g.get(v).into_iter().flatten() {
            let Some((w, _)) = s.g.get_key_value(w) else {
                continue;
            };
            if !s.index.contains_key(w) {
                visit(s, w);
                let l = s.low[v].min(s.low[w]);
                s.low.insert(v, l);
            } else if s.on.contains(w) {
                let l = s.low[v].min(s.index[w]);
                s.low.insert(v, l);
            }
        }
        if s.low[v] == s.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on.remove(w);
                comp.push(w.clone());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                s.out.push(comp);
            }
        }
    }
    let mut s = S {
        g,
        index: HashMap::new(),
        low: HashMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in g.keys() {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.out
}

fn name(m: &Module) -> String {
    if m.is_empty() {
        "(crate root)".into()
    } else {
        m.join("::")
    }
}

#[test]
fn no_crate_has_an_import_circle() {
    let crates = root().join("crates");
    let mut found = Vec::new();
    let mut checked = 0;
    for e in std::fs::read_dir(&crates).unwrap().flatten() {
        let src = e.path().join("src");
        if !src.is_dir() {
            continue;
        }
        let c = Crate::new(crate_modules(&src));
        checked += c.modules.len();
        for comp in circles(&c.graph()) {
            let names: Vec<String> = comp.iter().map(name).collect();
            found.push(format!(
                "{}: {}",
                e.file_name().to_string_lossy(),
                names.join(" <-> ")
            ));
        }
    }
    assert!(
        checked > 100,
        "only {checked} modules found under {crates:?}"
    );
    assert!(found.is_empty(), "import circles:\n{}", found.join("\n"));
}

/// The check finds what it is for: a planted circle through `use`, one
/// through an inline path and a re-export, and one between a module and
/// its parent; and nothing in a tree that only declares its children.
#[test]
fn the_check_finds_planted_circles() {
    let crate_of = |files: &[(&str, &str)]| {
        let modules = files
            .iter()
            .map(|(m, t)| {
                let m: Module = if m.is_empty() {
                    Vec::new()
                } else {
                    m.split("::").map(String::from).collect()
                };
                (m, t.to_string())
            })
            .collect();
        let c = Crate::new(modules);
        circles(&c.graph())
            .into_iter()
            .map(|comp| comp.iter().map(name).collect::<Vec<_>>().join(" <-> "))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        crate_of(&[
            ("", "mod a; mod b;"),
            ("a", "use crate::b::{X, Y as Z};\npub struct A;"),
            (
                "b",
                "pub struct X;\npub struct Y;\nfn f() { let _ = crate::a::A; }"
            ),
        ]),
        ["a <-> b"]
    );
    assert_eq!(
        crate_of(&[
            ("", "mod a; mod c;"),
            ("a", "mod inner;\npub use inner::Item;"),
            ("a::inner", "use crate::c::C;\npub struct Item;"),
            ("c", "pub struct C;\nfn f() -> crate::a::Item { todo!() }"),
        ]),
        ["a::inner <-> c"],
        "a re-export resolves to the module that defines the item"
    );
    assert_eq!(
        crate_of(&[
            ("", "mod p;"),
            ("p", "mod k;\nuse self::k::K;\npub struct P;"),
            ("p::k", "use super::P;\npub struct K;"),
        ]),
        ["p <-> p::k"]
    );
    assert!(crate_of(&[
        ("", "mod p;"),
        ("p", "mod k;\npub use k::K;\npub struct P;"),
        ("p::k", "use super::P;\n// use crate::q::Q;\npub struct K;"),
        (
            "p::tests",
            "use super::*; use crate::p::k::K; fn t() { let _ = crate::p::P; }"
        ),
    ])
    .is_empty());
    assert!(
        crate_of(&[
            ("", "mod a; mod b;"),
            ("a", "use crate::b::B;"),
            (
                "b",
                "pub struct B;\n#[cfg(test)]\nmod t {\n    use crate::a::*;\n}"
            ),
        ])
        .is_empty(),
        "a test module's imports do not count"
    );
}
