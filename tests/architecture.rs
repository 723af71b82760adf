//! The code map holds: no import circles between files of `src/`, and no import between
//! modules that the allowed-imports table of docs/architecture.md forbids (in the spirit of
//! rust-analyzer's tidy tests).
//!
//! Every path in code is read, not only `use crate::…` lines: `use` trees with `crate::`,
//! `super::` and `self::`, and inline paths such as `super::grad::fused_adamw(…)` or
//! `crate::ir::Attr::Str(…)`. Comments and string literals are skipped. A path is charged to
//! the file that defines the item it names, following `pub use` re-exports (a re-export is a
//! facade, not a dependency of the file that writes it). A `mod.rs` is a file like any other:
//! what its children share lives in a file of its own, so the parent can drive the children
//! without a circle. Inline `#[cfg(test)]` modules are skipped: a unit test may use anything.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// One library file's parse: its module path, what it defines and re-exports, the paths it uses.
#[derive(Debug, Default)]
struct FileFacts {
    /// Items defined at the file's top level (functions, types, constants, macros, modules).
    defines: BTreeSet<String>,
    /// `pub use` re-exports at the top level: exported name → the path it names.
    reexports: BTreeMap<String, UsePath>,
    /// `pub use path::*` at the top level.
    glob_reexports: Vec<UsePath>,
    /// Every other path the file uses.
    uses: Vec<UsePath>,
}

/// A path as written, with how deep in inline `mod { }` blocks it stood.
#[derive(Clone, Debug)]
struct UsePath {
    segments: Vec<String>,
    inline_depth: usize,
}

/// Replaces comments, string and character literals by spaces (newlines kept).
fn strip(src: &str) -> String {
    let b: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    while i < b.len() {
        let c = b[i];
        let next = b.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < b.len() && b[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == '/' && b.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if b[i] == '*' && b.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(b[i]));
                    i += 1;
                }
            }
        } else if (c == 'r' || (c == 'b' && next == Some('r'))) && !prev_is_ident(&b, i) && raw_string_start(&b, i).is_some() {
            let (open_len, hashes) = raw_string_start(&b, i).unwrap_or((0, 0));
            for _ in 0..open_len {
                out.push(' ');
            }
            i += open_len;
            while i < b.len() {
                if b[i] == '"' && (0..hashes).all(|h| b.get(i + 1 + h) == Some(&'#')) {
                    for _ in 0..=hashes {
                        out.push(' ');
                    }
                    i += 1 + hashes;
                    break;
                }
                out.push(blank(b[i]));
                i += 1;
            }
        } else if c == '"' {
            out.push(' ');
            i += 1;
            while i < b.len() && b[i] != '"' {
                if b[i] == '\\' {
                    out.push(' ');
                    i += 1;
                }
                if i < b.len() {
                    out.push(blank(b[i]));
                    i += 1;
                }
            }
            out.push(' ');
            i += 1;
        } else if c == '\'' {
            // a character literal ('x', '\n', '\u{1F600}'), or a lifetime ('a)
            if next == Some('\\') {
                out.push(' ');
                i += 1;
                while i < b.len() && b[i] != '\'' {
                    if b[i] == '\\' {
                        out.push(' ');
                        i += 1;
                    }
                    out.push(' ');
                    i += 1;
                }
                out.push(' ');
                i += 1;
            } else if b.get(i + 2) == Some(&'\'') {
                out.push_str("   ");
                i += 3;
            } else {
                out.push(c);
                i += 1;
            }
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

fn prev_is_ident(b: &[char], i: usize) -> bool {
    i > 0 && (b[i - 1].is_alphanumeric() || b[i - 1] == '_')
}

/// At `r"`, `r#"`, `br"`, …: the length of the opening and the number of `#`.
fn raw_string_start(b: &[char], i: usize) -> Option<(usize, usize)> {
    let mut j = i + if b[i] == 'b' { 2 } else { 1 };
    let mut hashes = 0;
    while b.get(j) == Some(&'#') {
        hashes += 1;
        j += 1;
    }
    (b.get(j) == Some(&'"')).then_some((j + 1 - i, hashes))
}

/// Identifiers, `::` and single punctuation characters.
fn tokens(src: &str) -> Vec<String> {
    let b: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c.is_whitespace() {
            i += 1;
        } else if c.is_alphanumeric() || c == '_' {
            let start = i;
            while i < b.len() && (b[i].is_alphanumeric() || b[i] == '_') {
                i += 1;
            }
            // raw identifiers
            if i - start == 1 && c == 'r' && b.get(i) == Some(&'#') {
                i += 1;
                let s2 = i;
                while i < b.len() && (b[i].is_alphanumeric() || b[i] == '_') {
                    i += 1;
                }
                out.push(b[s2..i].iter().collect());
            } else {
                out.push(b[start..i].iter().collect());
            }
        } else if c == ':' && b.get(i + 1) == Some(&':') {
            out.push("::".into());
            i += 2;
        } else {
            out.push(c.to_string());
            i += 1;
        }
    }
    out
}

const ITEM_KEYWORDS: &[&str] = &["fn", "struct", "enum", "trait", "type", "const", "static", "union", "mod"];

fn is_ident(t: &str) -> bool {
    t.chars().next().is_some_and(|c| c.is_alphabetic() || c == '_')
}

/// Parses a `use` tree starting at `toks[i]` (after `use`) into full paths; returns the paths
/// (a trailing `self` names the module itself; `*` is kept as a segment) with their `as`
/// aliases, and the index after the `;`.
fn parse_use_tree(toks: &[String], mut i: usize, prefix: &[String], out: &mut Vec<(Vec<String>, Option<String>)>) -> usize {
    let mut path = prefix.to_vec();
    while i < toks.len() {
        let t = toks[i].as_str();
        match t {
            "::" => i += 1,
            "{" => {
                i += 1;
                loop {
                    i = parse_use_tree(toks, i, &path, out);
                    match toks.get(i).map(String::as_str) {
                        Some(",") => {
                            i += 1;
                            if toks.get(i).map(String::as_str) == Some("}") {
                                return i + 1;
                            }
                        }
                        Some("}") => return i + 1,
                        _ => return i,
                    }
                }
            }
            "}" | "," | ";" => {
                if path.len() > prefix.len() {
                    out.push((path, None));
                }
                return i;
            }
            "as" => {
                let alias = toks.get(i + 1).cloned();
                out.push((path, alias));
                return i + 2;
            }
            "*" => {
                path.push("*".into());
                i += 1;
            }
            _ if is_ident(t) => {
                path.push(t.to_string());
                i += 1;
            }
            _ => i += 1,
        }
    }
    i
}

fn facts_of(src: &str) -> FileFacts {
    let toks = tokens(&strip(src));
    let mut f = FileFacts::default();
    let mut depth = 0usize;
    // brace depths at which inline `mod x {` blocks opened, and whether each is test-only
    let mut inline_mods: Vec<usize> = Vec::new();
    let mut test_mods: Vec<usize> = Vec::new();
    let mut cfg_test = false;
    let mut i = 0;
    while i < toks.len() {
        let t = toks[i].as_str();
        if t == "#" && toks[i + 1..].iter().take(6).map(String::as_str).eq(["[", "cfg", "(", "test", ")", "]"]) {
            cfg_test = true;
            i += 7;
            continue;
        }
        // what `#[cfg(test)] mod tests { … }` uses is the tests' business, not the file's
        if !test_mods.is_empty() && !matches!(t, "{" | "}") {
            i += 1;
            continue;
        }
        match t {
            "{" => depth += 1,
            "}" => {
                depth = depth.saturating_sub(1);
                if inline_mods.last() == Some(&depth) {
                    inline_mods.pop();
                }
                if test_mods.last() == Some(&depth) {
                    test_mods.pop();
                }
            }
            "mod" if toks.get(i + 2).map(String::as_str) == Some("{") => {
                if std::mem::take(&mut cfg_test) {
                    test_mods.push(depth);
                }
                inline_mods.push(depth);
                if depth == 0 {
                    f.defines.insert(toks[i + 1].clone());
                }
                i += 3;
                depth += 1;
                continue;
            }
            "use" => {
                // `pub use`, `pub(crate) use`, `pub(super) use` re-export
                let reexport = i >= 1 && (toks[i - 1] == "pub" || (toks[i - 1] == ")" && i >= 4 && toks[i - 4] == "pub"));
                let mut paths = Vec::new();
                let end = parse_use_tree(&toks, i + 1, &[], &mut paths);
                for (segments, alias) in paths {
                    let up = UsePath { segments: segments.clone(), inline_depth: inline_mods.len() };
                    if reexport && depth == 0 {
                        if segments.last().map(String::as_str) == Some("*") {
                            f.glob_reexports.push(up);
                        } else {
                            let name = alias.clone().unwrap_or_else(|| {
                                let last = segments.last().cloned().unwrap_or_default();
                                if last == "self" { segments.get(segments.len().wrapping_sub(2)).cloned().unwrap_or_default() } else { last }
                            });
                            f.reexports.insert(name, up);
                        }
                    } else {
                        f.uses.push(up);
                    }
                }
                i = end.max(i + 1);
                continue;
            }
            "macro_rules" if depth == 0 => {
                if let Some(name) = toks.get(i + 2) {
                    f.defines.insert(name.clone());
                }
            }
            _ if depth == 0 && ITEM_KEYWORDS.contains(&t) => {
                cfg_test = false;
                if let Some(name) = toks.get(i + 1).filter(|n| is_ident(n) && *n != "fn") {
                    f.defines.insert(name.clone());
                }
            }
            // an inline path: `crate::…`, `super::…`, `self::…`, or one starting at a name the
            // resolver knows (a child module)
            _ if is_ident(t) && (i == 0 || toks[i - 1] != "::") => {
                if toks.get(i + 1).map(String::as_str) == Some("::") {
                    let mut segments = vec![t.to_string()];
                    let mut j = i + 1;
                    while toks.get(j).map(String::as_str) == Some("::") && toks.get(j + 1).is_some_and(|n| is_ident(n)) {
                        segments.push(toks[j + 1].clone());
                        j += 2;
                    }
                    f.uses.push(UsePath { segments, inline_depth: inline_mods.len() });
                    i = j;
                    continue;
                }
            }
            _ => {}
        }
        i += 1;
    }
    f
}

/// The library's files: module path (`[]` for lib.rs) → facts.
struct Library {
    files: BTreeMap<Vec<String>, (PathBuf, FileFacts)>,
}

impl Library {
    fn new(sources: &BTreeMap<PathBuf, String>) -> Library {
        let mut files = BTreeMap::new();
        for (path, src) in sources {
            files.insert(module_path(path), (path.clone(), facts_of(src)));
        }
        Library { files }
    }

    /// The file defining what `p`, written in module `m`, names (None: outside the crate, or
    /// a path within the file itself).
    fn resolve(&self, m: &[String], p: &UsePath, guard: usize) -> Option<Vec<String>> {
        if guard > 16 {
            return None;
        }
        let s = &p.segments;
        let (mut cur, rest): (Vec<String>, &[String]) = match s.first().map(String::as_str) {
            Some("crate") => (Vec::new(), &s[1..]),
            Some("self") => {
                if p.inline_depth > 0 {
                    return None;
                }
                (m.to_vec(), &s[1..])
            }
            Some("super") => {
                // inside inline `mod x { }` blocks the first `super`s stay within the file
                let ups = s.iter().take_while(|x| *x == "super").count();
                if ups <= p.inline_depth || ups - p.inline_depth > m.len() {
                    return None;
                }
                (m[..m.len() - (ups - p.inline_depth)].to_vec(), &s[ups..])
            }
            // a path relative to the module: a child module of it (`use executor::Executor`)
            Some(first) if p.inline_depth == 0 && self.files.contains_key(&[m.to_vec(), vec![first.to_string()]].concat()) => (m.to_vec(), &s[..]),
            _ => return None,
        };
        for seg in rest {
            if seg == "self" || seg == "*" {
                break;
            }
            let mut sub = cur.clone();
            sub.push(seg.clone());
            if self.files.contains_key(&sub) {
                cur = sub;
                continue;
            }
            // an item of module `cur`
            let (_, facts) = self.files.get(&cur)?;
            if facts.defines.contains(seg) {
                return Some(cur);
            }
            if let Some(target) = facts.reexports.get(seg) {
                let mut path = target.clone();
                path.inline_depth = 0;
                return self.resolve(&cur, &path, guard + 1).or(Some(cur));
            }
            for g in &facts.glob_reexports {
                let mut base = g.clone();
                base.segments.pop();
                base.segments.push(seg.clone());
                base.inline_depth = 0;
                if let Some(found) = self.resolve(&cur, &base, guard + 1) {
                    return Some(found);
                }
            }
            return Some(cur);
        }
        Some(cur)
    }

    /// Edges between files: (from, to) module paths, each with one path that makes it.
    fn edges(&self) -> BTreeMap<(Vec<String>, Vec<String>), String> {
        let mut out = BTreeMap::new();
        for (m, (_, facts)) in &self.files {
            for p in &facts.uses {
                if let Some(t) = self.resolve(m, p, 0) {
                    if &t != m && self.files.contains_key(&t) {
                        out.entry((m.clone(), t)).or_insert_with(|| p.segments.join("::"));
                    }
                }
            }
        }
        out
    }

    fn file(&self, m: &[String]) -> String {
        self.files.get(m).map(|(p, _)| p.display().to_string()).unwrap_or_default()
    }
}

/// `runtime/rank.rs` → `[runtime, rank]`; `runtime/mod.rs` → `[runtime]`; `lib.rs` → `[]`.
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel.iter().map(|c| c.to_string_lossy().into_owned()).collect();
    if let Some(last) = parts.pop() {
        let stem = last.trim_end_matches(".rs").to_string();
        if stem != "mod" && stem != "lib" {
            parts.push(stem);
        }
    }
    parts
}

/// Strongly connected components with more than one file (Tarjan).
fn cycles(nodes: &[Vec<String>], edges: &BTreeMap<(Vec<String>, Vec<String>), String>) -> Vec<Vec<Vec<String>>> {
    let index_of: HashMap<&Vec<String>, usize> = nodes.iter().enumerate().map(|(i, n)| (n, i)).collect();
    let mut adj = vec![Vec::new(); nodes.len()];
    for (a, b) in edges.keys() {
        if let (Some(&x), Some(&y)) = (index_of.get(a), index_of.get(b)) {
            adj[x].push(y);
        }
    }
    struct T<'a> {
        adj: &'a [Vec<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(t: &mut T<'_>, v: usize) {
        t.index[v] = Some(t.next);
        t.low[v] = t.next;
        t.next += 1;
        t.stack.push(v);
        t.on[v] = true;
        for k in 0..t.adj[v].len() {
            let w = t.adj[v][k];
            match t.index[w] {
                None => {
                    visit(t, w);
                    t.low[v] = t.low[v].min(t.low[w]);
                }
                Some(iw) if t.on[w] => t.low[v] = t.low[v].min(iw),
                _ => {}
            }
        }
        if Some(t.low[v]) == t.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on[w] = false;
                comp.push(w);
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                t.out.push(comp);
            }
        }
    }
    let n = nodes.len();
    let mut t = T { adj: &adj, index: vec![None; n], low: vec![0; n], on: vec![false; n], stack: Vec::new(), next: 0, out: Vec::new() };
    for v in 0..n {
        if t.index[v].is_none() {
            visit(&mut t, v);
        }
    }
    t.out.into_iter().map(|c| c.into_iter().map(|i| nodes[i].clone()).collect()).collect()
}

/// The library's sources under `src/` (without `src/bin/`), relative to `src/`.
fn library_sources(src: &Path) -> BTreeMap<PathBuf, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let p = e.expect("directory entry").path();
            if p.is_dir() {
                if p != src.join("bin") {
                    stack.push(p);
                }
            } else if p.extension().is_some_and(|x| x == "rs") {
                let rel = p.strip_prefix(src).expect("under src").to_path_buf();
                out.insert(rel, std::fs::read_to_string(&p).expect("readable source"));
            }
        }
    }
    out
}

/// The circles among `sources`, each as its files (sorted) and one edge per pair.
fn circles_in(sources: &BTreeMap<PathBuf, String>) -> Vec<String> {
    let lib = Library::new(sources);
    let edges = lib.edges();
    let nodes: Vec<Vec<String>> = lib.files.keys().cloned().collect();
    let mut out = Vec::new();
    for comp in cycles(&nodes, &edges) {
        let set: BTreeSet<&Vec<String>> = comp.iter().collect();
        let mut lines: Vec<String> = edges
            .iter()
            .filter(|((a, b), _)| set.contains(a) && set.contains(b))
            .map(|((a, b), via)| format!("  {} → {} (`{via}`)", lib.file(a), lib.file(b)))
            .collect();
        lines.sort();
        let files: BTreeSet<String> = comp.iter().map(|m| lib.file(m)).collect();
        out.push(format!("{} files: {}\n{}", files.len(), files.into_iter().collect::<Vec<_>>().join(", "), lines.join("\n")));
    }
    out
}

/// The allowed-imports table of docs/architecture.md: module → the modules it may use.
fn allowed_table(doc: &str) -> BTreeMap<String, BTreeSet<String>> {
    let section = doc.split("## Allowed imports").nth(1).expect("docs/architecture.md has an `## Allowed imports` section");
    let mut out = BTreeMap::new();
    for line in section.lines().skip_while(|l| !l.starts_with('|')).take_while(|l| l.starts_with('|')) {
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        let [module, may] = cells.as_slice() else { continue };
        let name = module.trim_matches('`');
        if name == "module" || name.starts_with('-') || !module.starts_with('`') {
            continue;
        }
        let may: BTreeSet<String> = may.split(',').map(|s| s.trim().trim_matches('`').to_string()).filter(|s| !s.is_empty() && s != "—").collect();
        out.insert(name.to_string(), may);
    }
    out
}

/// The top module of a library module path (`lib` for the crate root).
fn top(m: &[String]) -> String {
    m.first().cloned().unwrap_or_else(|| "lib".into())
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn no_import_circles_between_files() {
    let circles = circles_in(&library_sources(&repo().join("src")));
    assert!(circles.is_empty(), "import circles between files of src/ (break each by moving the shared item down):\n{}", circles.join("\n"));
}

/// The module-level import edges of the library: module → the modules its files use.
fn module_edges(lib: &Library) -> BTreeMap<String, BTreeMap<String, String>> {
    let mut out: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for ((a, b), via) in lib.edges() {
        let (ta, tb) = (top(&a), top(&b));
        if ta != tb {
            out.entry(ta).or_default().entry(tb).or_insert_with(|| format!("{} (`{via}`)", lib.file(&a)));
        }
    }
    out
}

#[test]
fn imports_between_modules_follow_the_architecture_table() {
    let doc = std::fs::read_to_string(repo().join("docs/architecture.md")).expect("docs/architecture.md");
    let table = allowed_table(&doc);
    let sources = library_sources(&repo().join("src"));
    let lib = Library::new(&sources);
    let tops: BTreeSet<String> = lib.files.keys().map(|m| top(m)).collect();
    let missing: Vec<&String> = tops.iter().filter(|t| !table.contains_key(*t)).collect();
    assert!(missing.is_empty(), "modules missing from the allowed-imports table of docs/architecture.md: {missing:?}");
    let used = module_edges(&lib);
    let mut bad = Vec::new();
    for (a, targets) in &used {
        for (b, via) in targets {
            if !table[a].contains(b) {
                bad.push(format!("{via} uses {b}"));
            }
        }
    }
    assert!(bad.is_empty(), "imports the allowed-imports table of docs/architecture.md forbids:\n{}", bad.join("\n"));
    // the table states the imports that exist, no more: an allowed edge no import uses is stale
    let mut stale = Vec::new();
    for (a, may) in &table {
        for b in may {
            if !used.get(a).is_some_and(|u| u.contains_key(b)) {
                stale.push(format!("`{a}` may use `{b}`, but no file of {a} does"));
            }
        }
    }
    assert!(stale.is_empty(), "allowed imports in docs/architecture.md that no import uses (remove them from the table):\n{}", stale.join("\n"));
}

/// The allowed-imports table is ordered bottom up: a module uses only modules on rows above it.
#[test]
fn the_allowed_imports_table_points_only_down_the_spine() {
    let doc = std::fs::read_to_string(repo().join("docs/architecture.md")).expect("docs/architecture.md");
    let rows = table_rows(doc.split("## Allowed imports").nth(1).expect("an `## Allowed imports` section"));
    let mut seen = BTreeSet::new();
    let mut bad = Vec::new();
    for (module, may) in &rows {
        for m in may {
            if !seen.contains(m) {
                bad.push(format!("`{module}` may use `{m}`, which is not on a row above it"));
            }
        }
        seen.insert(module.clone());
    }
    assert!(bad.is_empty(), "the allowed-imports table points up the spine:\n{}", bad.join("\n"));
}

/// The rows of the first markdown table in `section` whose first cell is code: (first cell,
/// the code spans of the second cell).
fn table_rows(section: &str) -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    for line in section.lines().skip_while(|l| !l.starts_with('|')).take_while(|l| l.starts_with('|')) {
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        let (Some(first), Some(second)) = (cells.first(), cells.get(1)) else { continue };
        if !first.starts_with('`') {
            continue;
        }
        let may = second.split(',').map(|s| s.trim().trim_matches('`').to_string()).filter(|s| !s.is_empty() && s != "—").collect();
        out.push((first.trim_matches('`').to_string(), may));
    }
    out
}

/// The runtime's rooms, bottom up, as the rooms table of docs/architecture.md lists them
/// (`runtime/error.rs`, `runtime/comm/`, …).
fn runtime_rooms(doc: &str) -> Vec<String> {
    let section = doc.split("The runtime's rooms, bottom up").nth(1).expect("docs/architecture.md lists the runtime's rooms");
    table_rows(section).into_iter().map(|(room, _)| room).filter(|r| r.starts_with("runtime/")).collect()
}

/// The room of a runtime file (`None`: the runtime's facade, `runtime/mod.rs`).
fn room_of(rooms: &[String], file: &str) -> Option<usize> {
    rooms.iter().position(|r| if r.ends_with('/') { file.starts_with(r.as_str()) } else { file == r })
}

/// Each runtime room uses only the rooms above it in the rooms table (bottom up), and every
/// runtime file lies in a room.
#[test]
fn runtime_rooms_use_only_the_rooms_above_them() {
    let doc = std::fs::read_to_string(repo().join("docs/architecture.md")).expect("docs/architecture.md");
    let rooms = runtime_rooms(&doc);
    assert!(rooms.len() >= 5, "the rooms table of docs/architecture.md: {rooms:?}");
    let sources = library_sources(&repo().join("src"));
    let lib = Library::new(&sources);
    let homeless: Vec<String> = lib
        .files
        .values()
        .map(|(p, _)| p.display().to_string())
        .filter(|f| f.starts_with("runtime/") && f != "runtime/mod.rs" && room_of(&rooms, f).is_none())
        .collect();
    assert!(homeless.is_empty(), "runtime files in no room of docs/architecture.md's rooms table: {homeless:?}");
    let mut bad = Vec::new();
    for ((a, b), via) in lib.edges() {
        let (fa, fb) = (lib.file(&a), lib.file(&b));
        if let (Some(ra), Some(rb)) = (room_of(&rooms, &fa), room_of(&rooms, &fb)) {
            if rb > ra {
                bad.push(format!("{fa} ({}) uses {fb} ({}) through `{via}`, a room below it", rooms[ra], rooms[rb]));
            }
        }
    }
    assert!(bad.is_empty(), "runtime rooms importing a room below them in docs/architecture.md's table:\n{}", bad.join("\n"));
}

/// The folders docs/architecture.md's file map covers, and those it describes as a whole.
const MAPPED_ROOTS: &[&str] = &["src", "benches", "scripts", "tests", "python", "csrc", "proto", "fuzz"];
const UNMAPPED_DIRS: &[&str] = &["tests/data", "tests/snapshots", "fuzz/corpus"];

/// The files under the mapped roots, as `dir/name` relative to the repository (build outputs,
/// caches and hidden files left out).
fn files_on_disk() -> BTreeSet<String> {
    let root = repo();
    let mut out = BTreeSet::new();
    let mut stack: Vec<PathBuf> = MAPPED_ROOTS.iter().map(|r| root.join(r)).collect();
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for e in entries {
            let p = e.expect("directory entry").path();
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            let rel = p.strip_prefix(&root).expect("under the repository").to_string_lossy().replace('\\', "/");
            if name.starts_with('.') || name == "__pycache__" || name == "target" || name.ends_with(".egg-info") || name.ends_with(".pyc") {
                continue;
            }
            if p.is_dir() {
                if !UNMAPPED_DIRS.contains(&rel.as_str()) {
                    stack.push(p);
                }
            } else {
                out.insert(rel);
            }
        }
    }
    out
}

/// The files the `## Files` section of docs/architecture.md lists: `### \`dir/\`` headings,
/// then table rows whose first cell is a file name.
fn files_on_the_map(doc: &str) -> BTreeSet<String> {
    let section = doc.split("\n## Files\n").nth(1).expect("docs/architecture.md has a `## Files` section");
    let section = section.split("\n## ").next().unwrap_or(section);
    let mut out = BTreeSet::new();
    let mut dir = None;
    for line in section.lines() {
        if let Some(h) = line.strip_prefix("### `") {
            dir = Some(h.trim_end_matches('`').to_string());
        } else if let (Some(d), Some(row)) = (&dir, line.strip_prefix("| `")) {
            let name = row.split('`').next().unwrap_or_default();
            out.insert(format!("{d}{name}"));
        }
    }
    out
}

/// docs/architecture.md lists every file of the code, tests, benches, scripts and the Python
/// package, and no file that is gone.
#[test]
fn every_file_is_on_the_map() {
    let doc = std::fs::read_to_string(repo().join("docs/architecture.md")).expect("docs/architecture.md");
    let listed = files_on_the_map(&doc);
    let disk = files_on_disk();
    let missing: Vec<&String> = disk.difference(&listed).collect();
    let gone: Vec<&String> = listed.difference(&disk).collect();
    assert!(
        missing.is_empty() && gone.is_empty(),
        "docs/architecture.md's file map is out of date (run `python3 scripts/file_map.py`, then check its lines):\nmissing: {missing:?}\nlisted but gone: {gone:?}"
    );
}

/// Every Rust file under `src/` (binaries included), relative to `src/`, with its tokens.
fn all_tokens() -> Vec<(PathBuf, Vec<String>)> {
    let src = repo().join("src");
    let mut out = Vec::new();
    let mut stack = vec![src.clone()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).expect("src/") {
            let p = e.expect("entry").path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let toks = tokens(&strip(&std::fs::read_to_string(&p).expect("source")));
                out.push((p.strip_prefix(&src).expect("under src").to_path_buf(), toks));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn only_runtime_names_tch_or_c10d() {
    let bad: Vec<String> = all_tokens()
        .into_iter()
        .filter(|(p, toks)| !p.starts_with("runtime") && toks.iter().any(|t| t == "tch" || t == "torch_sys" || t == "c10d"))
        .map(|(p, _)| p.display().to_string())
        .collect();
    assert!(bad.is_empty(), "files outside src/runtime/ naming tch or c10d: {bad:?}");
}

/// ONNX is canonicalised once, by the importer (`frontend/onnx/canonical.rs`): no later stage
/// reads the opset, so none can branch on it. `ir/` keeps the opsets for the IR dump.
#[test]
fn only_the_importer_reads_the_opset() {
    let bad: Vec<String> = all_tokens()
        .into_iter()
        .filter(|(p, toks)| !p.starts_with("frontend/onnx") && !p.starts_with("ir") && toks.iter().any(|t| t == "opset" || t == "opsets"))
        .map(|(p, _)| p.display().to_string())
        .collect();
    assert!(bad.is_empty(), "files outside the ONNX importer reading the opset (canonicalise the form in frontend/onnx/canonical.rs instead): {bad:?}");
}

/// The plan carries what runs: the runner rebuilds the planned graph and its stage subgraphs
/// through codegen (`codegen::stage_graph`), the one place that applies the plan's records, and
/// runs none of analysis's rewrites itself.
#[test]
fn the_runtime_runs_no_analysis_rewrite() {
    let bad: Vec<String> = all_tokens()
        .into_iter()
        .filter(|(p, toks)| p.starts_with("runtime") && toks.windows(3).any(|w| w[0] == "passes" && w[1] == "::" && ["specialise", "fuse", "rebatch"].contains(&w[2].as_str())))
        .map(|(p, _)| p.display().to_string())
        .collect();
    assert!(bad.is_empty(), "runtime files using passes::specialise, fuse or rebatch (go through codegen::stage_graph): {bad:?}");
}

/// Adding an op is a checklist (docs/architecture.md, "Adding an op"): `split::family::family`
/// places every `OpKind` in one family (an exhaustive match), and each of split's engines
/// dispatches on the family with an arm for every one of them and no catch-all, so a new op or
/// family cannot fall through an engine unnoticed.
#[test]
fn every_split_engine_has_an_arm_for_every_op_family() {
    let read = |f: &str| strip(&std::fs::read_to_string(repo().join("src/split").join(f)).expect("split source"));
    let family_src = read("family.rs");
    let start = family_src.find("pub enum Family").expect("split/family.rs declares `pub enum Family`");
    let body = &family_src[start..family_src[start..].find('}').map(|e| start + e).expect("the enum's end")];
    let families: Vec<String> = tokens(body).into_iter().skip(3).filter(|t| is_ident(t) && t.chars().next().is_some_and(char::is_uppercase)).collect();
    assert!(families.len() >= 8, "families read from split/family.rs: {families:?}");
    for engine in ["realise.rs", "sequence.rs", "context.rs"] {
        let src = read(engine);
        let at: Vec<usize> = src.match_indices("match family(").map(|(i, _)| i).collect();
        assert_eq!(at.len(), 1, "split/{engine} dispatches on the family once");
        let open = at[0] + src[at[0]..].find('{').expect("the match's block");
        let (mut depth, mut end) = (0usize, open);
        for (i, c) in src[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                _ => {}
            }
            if depth == 0 {
                end = open + i;
                break;
            }
        }
        let block = &src[open + 1..end];
        for f in &families {
            assert!(block.contains(&format!("Family::{f}")), "split/{engine}'s family dispatch has no arm for Family::{f}");
        }
        // arms at the block's own depth: none may be a catch-all
        let (mut d, mut top) = (0i32, String::new());
        for c in block.chars() {
            match c {
                '{' | '(' | '[' => d += 1,
                '}' | ')' | ']' => d -= 1,
                _ if d == 0 => top.push(c),
                _ => {}
            }
        }
        assert!(!tokens(&top).windows(2).any(|w| w[0] == "_" && w[1] == "="), "split/{engine}'s family dispatch has a catch-all arm");
    }
}

/// Where serde may appear: the files of a file format, as docs/architecture.md lists them.
const SERDE_ALLOWED: &[&str] = &[
    "plan/",
    "codegen/",
    "split/",
    "ir/fusion.rs",
    "ir/collective.rs",
    "ir/parallel.rs",
    "cost/",
    "solve/smp_config.rs",
    "solve/problem.rs",
    "solve/ilp.rs",
    "solve/pipeline.rs",
    "frontend/onnx/record.rs",
    "sim/trace.rs",
    "engines/",
    "runtime/data/",
    "runtime/state/",
    "runtime/launch/calibrate.rs",
    "runtime/session/report.rs",
    "runtime/train/",
    "bin/",
];

#[test]
fn serde_only_on_file_formats() {
    let bad: Vec<String> = all_tokens()
        .into_iter()
        .filter(|(p, toks)| {
            let p = p.to_string_lossy();
            toks.iter().any(|t| t == "serde" || t == "serde_json") && !SERDE_ALLOWED.iter().any(|a| p.starts_with(a))
        })
        .map(|(p, _)| p.display().to_string())
        .collect();
    assert!(bad.is_empty(), "serde outside the file formats docs/architecture.md lists: {bad:?}");
    let doc = std::fs::read_to_string(repo().join("docs/architecture.md")).expect("docs/architecture.md");
    let unlisted: Vec<&&str> = SERDE_ALLOWED.iter().filter(|a| **a != "bin/" && !doc.contains(a.trim_start_matches("runtime/"))).collect();
    assert!(unlisted.is_empty(), "serde places the test allows but docs/architecture.md does not name: {unlisted:?}");
}

#[test]
fn binaries_call_no_stage_past_the_front_doors() {
    let bin = repo().join("src/bin");
    let mut stack = vec![bin];
    let mut bad = Vec::new();
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).expect("src/bin") {
            let p = e.expect("entry").path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let toks = tokens(&strip(&std::fs::read_to_string(&p).expect("source")));
                for w in toks.windows(3) {
                    if w[0] == "smp_partition" && w[1] == "::" && (w[2] == "passes" || w[2] == "codegen") {
                        bad.push(format!("{} uses smp_partition::{}", p.display(), w[2]));
                    }
                }
            }
        }
    }
    bad.sort();
    bad.dedup();
    assert!(bad.is_empty(), "binaries reaching past the front doors into passes or codegen:\n{}", bad.join("\n"));
}

/// The checker itself: a circle through `super::` and an inline path is found, a re-export is
/// not charged to the file that writes it, and a test module's `super::*` is its own file.
#[test]
fn the_checker_sees_circles_through_every_kind_of_path() {
    let tree = |files: &[(&str, &str)]| -> BTreeMap<PathBuf, String> { files.iter().map(|(p, s)| (PathBuf::from(p), s.to_string())).collect() };
    let circle = tree(&[
        ("lib.rs", "pub mod a;"),
        ("a/mod.rs", "pub mod b; pub mod c; pub use b::Thing; pub struct Error;"),
        ("a/b.rs", "use super::c::helper; pub struct Thing; fn f() { helper() }"),
        ("a/c.rs", "pub fn helper() { let _ = crate::a::Thing; } // use super::b::X;\n"),
    ]);
    let found = circles_in(&circle);
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].contains("a/b.rs") && found[0].contains("a/c.rs") && !found[0].contains("a/mod.rs"), "{}", found[0]);

    // a folder's mod.rs that defines what its children use and calls into them is a circle
    let parent = tree(&[
        ("lib.rs", "pub mod a;"),
        ("a/mod.rs", "mod b; pub struct Error; pub fn run() { b::step() }"),
        ("a/b.rs", "pub fn step() -> super::Error { super::Error }"),
    ]);
    let found = circles_in(&parent);
    assert!(found.len() == 1 && found[0].contains("a/mod.rs") && found[0].contains("a/b.rs"), "{found:?}");

    let clean = tree(&[
        ("lib.rs", "pub mod a;"),
        ("a/mod.rs", "pub mod b; pub mod c; pub mod d; pub mod e; mod error; pub use b::Thing; pub use error::Error;"),
        ("a/error.rs", "pub struct Error;"),
        ("a/b.rs", "use super::Error; pub struct Thing; #[cfg(test)] mod tests { use super::*; }"),
        ("a/c.rs", "/* crate::a::b::Thing */ pub fn helper() -> &'static str { \"super::b::Thing\" }"),
        ("a/d.rs", "pub fn f() {} #[cfg(test)] mod tests { use crate::a::e::g; }"),
        ("a/e.rs", "pub fn g() { super::d::f() }"),
    ]);
    assert!(circles_in(&clean).is_empty(), "{:?}", circles_in(&clean));
}

#[test]
fn the_table_parser_reads_the_documented_table() {
    let doc = "## Allowed imports\n\n| module | may use |\n|---|---|\n| `ir` | — |\n| `passes` | `ir`, `frontend` |\n\nafter";
    let t = allowed_table(doc);
    assert_eq!(t["ir"], BTreeSet::new());
    assert_eq!(t["passes"], ["ir", "frontend"].iter().map(|s| s.to_string()).collect());
}

/// Prints the largest files and longest functions of `src/` (for closing notes).
#[test]
fn size_report() {
    let sources = library_sources(&repo().join("src"));
    let mut files: Vec<(usize, String)> = sources.iter().map(|(p, s)| (s.lines().count(), p.display().to_string())).collect();
    files.sort_by(|a, b| b.cmp(a));
    let mut fns: Vec<(usize, String)> = Vec::new();
    for (p, s) in &sources {
        let stripped = strip(s);
        let lines: Vec<&str> = stripped.lines().collect();
        for (i, l) in lines.iter().enumerate() {
            let t = l.trim_start();
            let is_fn = t.starts_with("fn ") || t.starts_with("pub fn ") || t.starts_with("pub(crate) fn ") || t.starts_with("pub(super) fn ") || t.starts_with("const fn ") || t.starts_with("pub const fn ");
            if !is_fn {
                continue;
            }
            let name = t.split("fn ").nth(1).and_then(|r| r.split(['(', '<']).next()).unwrap_or("").to_string();
            let mut depth = 0i64;
            let mut opened = false;
            for (j, l2) in lines.iter().enumerate().skip(i) {
                for c in l2.chars() {
                    match c {
                        '{' => {
                            depth += 1;
                            opened = true;
                        }
                        '}' => depth -= 1,
                        ';' if !opened && depth == 0 => break,
                        _ => {}
                    }
                }
                if opened && depth == 0 {
                    fns.push((j - i + 1, format!("{}::{name}", p.display())));
                    break;
                }
                if !opened && l2.trim_end().ends_with(';') {
                    break;
                }
            }
        }
    }
    fns.sort_by(|a, b| b.cmp(a));
    eprintln!("largest files: {:?}", &files[..5.min(files.len())]);
    eprintln!("longest functions: {:?}", &fns[..5.min(fns.len())]);
    assert!(!files.is_empty() && !fns.is_empty(), "src/ has no Rust files or functions");
}

#[test]
#[ignore = "prints the module-level import edges (for docs/architecture.md)"]
fn print_module_edges() {
    let sources = library_sources(&repo().join("src"));
    let lib = Library::new(&sources);
    let mut tops: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (a, b) in lib.edges().keys() {
        if top(a) != top(b) {
            tops.entry(top(a)).or_default().insert(top(b));
        }
    }
    for (a, bs) in tops {
        eprintln!("{a}: {bs:?}");
    }
}
