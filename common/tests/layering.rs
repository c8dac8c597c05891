//! No cycle of modules, of any length, anywhere in the workspace: the source of every crate is
//! read, each module's references to other modules of its crate (`use crate::...`,
//! `crate::x::` paths, `super::`, and a parent's uses of its declared children) become edges,
//! and every strongly connected component of more than one module fails the test, named with
//! one cycle through it.
//!
//! And no file holds more than 700 lines of production code (what comes before its
//! `#[cfg(test)]` module).
//!
//! Needs no Kafka or Redis: it reads files.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Each crate's source directory, relative to the workspace root.
const CRATES: [&str; 9] = [
    "common/src",
    "kafka/src",
    "ops/src",
    "producer/src",
    "aggregator/src",
    "cli/src",
    "server/src",
    "tests/src",
    "bench/src",
];

/// A module path inside its crate: `[]` for the root, `["consume"]`, `["codec", "json"]`.
type Module = Vec<String>;

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            // Binaries are crates of their own that only use the library.
            if path.file_name().is_some_and(|n| n != "bin") {
                rust_files(&path, out);
            }
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module a file holds.
fn module_of(src: &Path, file: &Path) -> Module {
    let relative = file.strip_prefix(src).expect("under src");
    let mut parts: Vec<String> = relative
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_owned())
        .collect();
    if matches!(
        parts.last().map(String::as_str),
        Some("mod" | "lib" | "main")
    ) {
        parts.pop();
    }
    parts
}

/// The source without comments (line comments and doc comments; block comments are not used).
fn code_lines(text: &str) -> Vec<String> {
    text.lines()
        .map(|line| match line.find("//") {
            // A `//` inside a string literal (a URL) is rare in paths we look for; cut anyway.
            Some(at) => line[..at].to_owned(),
            None => line.to_owned(),
        })
        .collect()
}

/// Identifiers following `prefix` in `code` (`crate::` → `consume`, `fence`...), each with the
/// path segments after it.
fn paths_after(code: &str, prefix: &str) -> Vec<Vec<String>> {
    let mut found = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find(prefix) {
        let before = rest[..at].chars().last();
        rest = &rest[at + prefix.len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let segments: Vec<String> = rest
            .split("::")
            .map(|s| {
                s.chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect::<String>()
            })
            .take_while(|s| !s.is_empty())
            .collect();
        found.push(segments);
    }
    found
}

/// The longest module of `modules` that `path` (segments from the crate root) names; the root
/// when it names an item of the root.
fn resolve(modules: &BTreeSet<Module>, path: &[String]) -> Module {
    (0..=path.len())
        .rev()
        .map(|n| path[..n].to_vec())
        .find(|m| modules.contains(m))
        .unwrap_or_default()
}

/// Every edge `from → to` of one crate.
fn edges(src: &Path) -> BTreeSet<(Module, Module)> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let modules: BTreeSet<Module> = files.iter().map(|f| module_of(src, f)).collect();
    let mut edges = BTreeSet::new();
    for file in &files {
        let from = module_of(src, file);
        let text = std::fs::read_to_string(file).expect("readable source");
        for line in code_lines(&text) {
            let line = line.trim();
            for path in paths_after(line, "crate::") {
                edges.insert((from.clone(), resolve(&modules, &path)));
            }
            for path in paths_after(line, "super::") {
                // `super::` from a file module is its parent; `super::*` in a file's own test
                // module is the file itself.
                if path.is_empty() || line.contains("super::*") {
                    continue;
                }
                let parent = from[..from.len().saturating_sub(1)].to_vec();
                let target = [parent.clone(), path].concat();
                edges.insert((from.clone(), resolve(&modules, &target)));
            }
            // A module's uses of its own declared children (`use json::json_catch_up;`).
            if let Some(rest) = line
                .strip_prefix("use ")
                .or_else(|| line.strip_prefix("pub use "))
            {
                let first = rest.split("::").next().unwrap_or_default();
                let child = [from.clone(), vec![first.to_owned()]].concat();
                if modules.contains(&child) {
                    edges.insert((from.clone(), child));
                }
            }
        }
    }
    edges.retain(|(from, to)| from != to);
    edges
}

fn name(crate_dir: &str, module: &Module) -> String {
    if module.is_empty() {
        format!("{crate_dir} (root)")
    } else {
        format!("{crate_dir}::{}", module.join("::"))
    }
}

/// The modules `from` reaches through `edges`.
fn reachable(edges: &BTreeSet<(Module, Module)>, from: &Module) -> BTreeSet<Module> {
    let mut seen = BTreeSet::new();
    let mut stack = vec![from.clone()];
    while let Some(module) = stack.pop() {
        let next = edges.iter().filter(|(f, _)| *f == module).map(|(_, t)| t);
        for to in next {
            if seen.insert(to.clone()) {
                stack.push(to.clone());
            }
        }
    }
    seen
}

/// The strongly connected components of more than one module (every module in one reaches
/// every other), each in module order.
fn cycles(edges: &BTreeSet<(Module, Module)>) -> Vec<Vec<Module>> {
    let modules: BTreeSet<&Module> = edges.iter().flat_map(|(f, t)| [f, t]).collect();
    let reach: BTreeMap<&Module, BTreeSet<Module>> =
        modules.iter().map(|m| (*m, reachable(edges, m))).collect();
    let mut placed = BTreeSet::new();
    let mut components = Vec::new();
    for module in &modules {
        if placed.contains(*module) || !reach[module].contains(*module) {
            continue;
        }
        let component: Vec<Module> = (modules.iter())
            .filter(|other| reach[module].contains(**other) && reach[**other].contains(*module))
            .map(|m| (*m).clone())
            .collect();
        placed.extend(component.iter().cloned());
        components.push(component);
    }
    components
}

/// One cycle through `component`'s first module, as a path back to it (breadth first: the
/// shortest).
fn one_cycle(edges: &BTreeSet<(Module, Module)>, component: &[Module]) -> Vec<Module> {
    let start = &component[0];
    let mut came_from: BTreeMap<Module, Module> = BTreeMap::new();
    let mut queue = std::collections::VecDeque::from([start.clone()]);
    while let Some(module) = queue.pop_front() {
        for (_, to) in edges.iter().filter(|(f, _)| *f == module) {
            if to == start {
                let mut path = vec![start.clone(), module.clone()];
                while let Some(previous) = came_from.get(path.last().expect("non-empty")) {
                    path.push(previous.clone());
                }
                path.reverse();
                return path;
            }
            if component.contains(to) && !came_from.contains_key(to) {
                came_from.insert(to.clone(), module.clone());
                queue.push_back(to.clone());
            }
        }
    }
    unreachable!("a component's module reaches itself")
}

#[test]
fn no_cycle_of_modules_in_any_crate() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut found = Vec::new();
    let mut counted = BTreeMap::new();
    for crate_dir in CRATES {
        let edges = edges(&root.join(crate_dir));
        counted.insert(crate_dir, edges.len());
        for component in cycles(&edges) {
            let names: Vec<String> = component.iter().map(|m| name(crate_dir, m)).collect();
            let cycle: Vec<String> = (one_cycle(&edges, &component).iter())
                .map(|m| name(crate_dir, m))
                .collect();
            found.push(format!(
                "{}\n  e.g. {}",
                names.join(", "),
                cycle.join(" -> ")
            ));
        }
    }
    assert!(
        counted.values().sum::<usize>() > 100,
        "too few module edges found to trust the check: {counted:?}"
    );
    assert!(found.is_empty(), "modules in cycles:\n{}", found.join("\n"));
    println!("module edges per crate: {counted:?}");
}

/// The edges between rooms, each crate's top-level modules: every edge between two modules of
/// different rooms, as an edge between their rooms (the crate root, which declares the rooms
/// and re-exports from them, is left out).
fn room_edges(edges: &BTreeSet<(Module, Module)>) -> BTreeSet<(Module, Module)> {
    (edges.iter())
        .filter(|(from, to)| !from.is_empty() && !to.is_empty() && from[0] != to[0])
        .map(|(from, to)| (from[..1].to_vec(), to[..1].to_vec()))
        .collect()
}

/// Rooms form layers: no two rooms of a crate reach each other, though no two of their files
/// need import each other for them to (a file of `store` importing `tasks`, one of `tasks`
/// importing `consume`, one of `consume` importing `store`).
#[test]
fn no_cycle_of_rooms_in_any_crate() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut found = Vec::new();
    let mut counted = BTreeMap::new();
    for crate_dir in CRATES {
        let edges = edges(&root.join(crate_dir));
        let rooms = room_edges(&edges);
        counted.insert(crate_dir, rooms.len());
        for component in cycles(&rooms) {
            let names: Vec<String> = component.iter().map(|m| name(crate_dir, m)).collect();
            // One file edge per room edge of a cycle through the component, to show where.
            let cycle = one_cycle(&rooms, &component);
            let why: Vec<String> = (cycle.windows(2))
                .filter_map(|pair| {
                    (edges.iter())
                        .find(|(f, t)| f.first() == pair[0].first() && t.first() == pair[1].first())
                        .map(|(f, t)| format!("{} -> {}", name(crate_dir, f), name(crate_dir, t)))
                })
                .collect();
            found.push(format!(
                "{}
  e.g. {}",
                names.join(", "),
                why.join(", ")
            ));
        }
    }
    assert!(
        counted["aggregator/src"] >= 5,
        "too few room edges found to trust the check: {counted:?}"
    );
    assert!(found.is_empty(), "rooms in cycles:\n{}", found.join("\n"));
}

#[test]
fn the_checker_sees_a_cycle_when_there_is_one() {
    let dir = std::env::temp_dir().join(format!("tally-layering-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("b")).expect("dir");
    std::fs::write(dir.join("lib.rs"), "mod a;\nmod b;\n").expect("lib");
    std::fs::write(dir.join("a.rs"), "use crate::b::thing;\n").expect("a");
    std::fs::write(dir.join("b/mod.rs"), "mod c;\nmod d;\n").expect("b");
    std::fs::write(dir.join("b/d.rs"), "").expect("d");
    std::fs::write(
        dir.join("b/c.rs"),
        "use super::d;\nfn f() { crate::a::y(); }\n",
    )
    .expect("c");
    let e = edges(&dir);
    let m = |s: &str| -> Module { s.split('/').map(str::to_owned).collect() };
    assert!(e.contains(&(m("a"), m("b"))));
    assert!(e.contains(&(m("b/c"), m("a"))));
    assert!(e.contains(&(m("b/c"), m("b/d"))), "{e:?}");
    std::fs::write(dir.join("b/mod.rs"), "mod c;\nmod d;\nuse crate::a::z;\n").expect("b");
    let e = edges(&dir);
    assert!(e.contains(&(m("a"), m("b"))) && e.contains(&(m("b"), m("a"))));
    assert_eq!(cycles(&e), vec![vec![m("a"), m("b")]]);
    // Three modules, no pair importing each other: a -> b -> c -> a.
    std::fs::write(dir.join("b/mod.rs"), "mod c;\nmod d;\npub use c::thing;\n").expect("b");
    std::fs::write(dir.join("b/c.rs"), "fn f() { crate::a::y(); }\n").expect("c");
    let e = edges(&dir);
    assert_eq!(cycles(&e), vec![vec![m("a"), m("b"), m("b/c")]]);
    assert_eq!(
        one_cycle(&e, &cycles(&e)[0]),
        [m("a"), m("b"), m("b/c"), m("a")]
    );
    // Rooms: b/c -> a and a -> b make rooms a and b a cycle, though a and b/c were one
    // already; with b/c importing b/d only, the files have no cycle and the rooms none.
    assert_eq!(cycles(&room_edges(&e)), vec![vec![m("a"), m("b")]]);
    std::fs::write(dir.join("b/c.rs"), "use super::d;\n").expect("c");
    std::fs::write(dir.join("b/d.rs"), "fn f() { crate::a::y(); }\n").expect("d");
    std::fs::write(dir.join("b/mod.rs"), "mod c;\nmod d;\n").expect("b");
    let e = edges(&dir);
    assert!(cycles(&e).is_empty(), "{e:?}");
    assert_eq!(cycles(&room_edges(&e)), vec![vec![m("a"), m("b")]]);
    std::fs::remove_dir_all(dir).ok();
}

/// Most lines of production code in one file.
const MAX_LINES: usize = 700;

/// Lines before the file's unit-test module (`#[cfg(test)]` then `mod tests`, or
/// `pub(crate) mod tests` when other modules' tests share its helpers, at the top level), or
/// all of them without one. A `#[cfg(test)]` on any other item counts as code.
fn production_lines(text: &str) -> usize {
    let lines: Vec<&str> = text.lines().collect();
    let test_module = |line: &str| {
        let line = line.strip_prefix("pub(crate) ").unwrap_or(line);
        line.starts_with("mod tests")
    };
    (lines.windows(2))
        .position(|pair| pair[0] == "#[cfg(test)]" && test_module(pair[1]))
        .unwrap_or(lines.len())
}

#[test]
fn only_the_test_module_is_left_out_of_the_count() {
    let code = "fn a() {}\n    #[cfg(test)]\n    fn helper() {}\nfn b() {}\n";
    assert_eq!(production_lines(code), 4);
    let with_tests = format!("{code}#[cfg(test)]\nmod tests {{\n}}\n");
    assert_eq!(production_lines(&with_tests), 4);
    let shared = format!("{code}#[cfg(test)]\npub(crate) mod tests {{\n}}\n");
    assert_eq!(production_lines(&shared), 4);
    let public = format!("{code}#[cfg(test)]\npub mod tests {{\n}}\n");
    assert_eq!(production_lines(&public), 7, "a public module is an API");
}

#[test]
fn no_file_over_700_lines_of_production_code() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut over = Vec::new();
    let mut seen = 0;
    for crate_dir in CRATES {
        let src = root.join(crate_dir);
        let mut files = Vec::new();
        rust_files(&src, &mut files);
        let bins = src.join("bin");
        rust_files(&bins, &mut files);
        for file in files {
            seen += 1;
            let text = std::fs::read_to_string(&file).expect("readable source");
            let lines = production_lines(&text);
            let relative = file.strip_prefix(&root).expect("under the root");
            let name = relative.to_string_lossy().replace('\\', "/");
            if lines > MAX_LINES {
                over.push(format!("{name}: {lines} lines (at most {MAX_LINES})"));
            }
        }
    }
    assert!(seen > 100, "too few files found to trust the check: {seen}");
    assert!(over.is_empty(), "files too long:\n{}", over.join("\n"));
}

/// The aggregator's rooms from the ground up: `machine` (the core, no I/O), `store`, `tasks`,
/// `consume`. A room imports only rooms below it. `operator` (configuration, metrics, the HTTP
/// endpoint) stands beside them: the rooms above the core may use it, and it uses the core only.
const AGGREGATOR_ROOMS: [&str; 4] = ["machine", "store", "tasks", "consume"];

#[test]
fn the_aggregators_rooms_import_only_rooms_below_them() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let edges = edges(&root.join("aggregator/src"));
    let level = |room: &str| AGGREGATOR_ROOMS.iter().position(|r| *r == room);
    let allowed = |from: &str, to: &str| match (from, to) {
        ("operator", to) => to == "machine",
        (from, "operator") => from != "machine",
        (from, to) => level(from).zip(level(to)).is_some_and(|(f, t)| t < f),
    };
    let rooms: BTreeSet<&str> = (edges.iter())
        .flat_map(|(f, t)| [f, t])
        .filter_map(|m| m.first().map(String::as_str))
        .collect();
    let unplaced: Vec<&&str> = (rooms.iter())
        .filter(|r| **r != "operator" && level(r).is_none())
        .collect();
    assert!(
        unplaced.is_empty(),
        "rooms with no place in the layers: {unplaced:?}"
    );
    let up: Vec<String> = (edges.iter())
        .filter(|(from, to)| !from.is_empty() && !to.is_empty() && from[0] != to[0])
        .filter(|(from, to)| !allowed(&from[0], &to[0]))
        .map(|(from, to)| format!("{} -> {}", from.join("::"), to.join("::")))
        .collect();
    assert!(
        rooms.len() == AGGREGATOR_ROOMS.len() + 1,
        "every room's edges are found: {rooms:?}"
    );
    assert!(
        up.is_empty(),
        "imports of rooms not below:\n{}",
        up.join("\n")
    );
}
