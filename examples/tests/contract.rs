//! `CONTRACT.md` and the docs agree: every behaviour id a doc cites has a
//! row there, every row says what proves it, and every test function and
//! benchmark program a row names exists.
//!
//! A citation is an id in brackets, as Markdown writes it or escaped for
//! rustdoc, alone or in a list or range (`H1, L1`, `A1–A6`), in any `.md`
//! or `.rs` file of the workspace. `target/` and hidden directories are
//! skipped. CHANGELOG.md is scanned too: ids keep their meaning for good
//! (a dropped behaviour keeps its row), so a citation in an old entry
//! stays valid.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// The letters of the contract's id families.
const FAMILIES: &str = "OAHLRCMSTGFNEDP";

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("examples/ is inside the workspace")
        .to_path_buf()
}

/// Every `.md` and `.rs` file under `dir`, skipping `target` and hidden
/// directories.
fn sources(dir: &Path, found: &mut Vec<PathBuf>) {
    let entries = fs::read_dir(dir).unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()));
    for entry in entries {
        let entry = entry.expect("a directory entry");
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        let kind = entry.file_type().expect("a file type");
        if kind.is_dir() {
            if name != "target" && !name.starts_with('.') {
                sources(&path, found);
            }
        } else if kind.is_file() && (name.ends_with(".md") || name.ends_with(".rs")) {
            found.push(path);
        }
    }
}

/// `("H", 7)` for `H7`, if `text` is exactly an id.
fn parse_id(text: &str) -> Option<(char, u32)> {
    let mut chars = text.chars();
    let family = chars.next().filter(|c| FAMILIES.contains(*c))?;
    let digits = chars.as_str();
    if digits.is_empty() || digits.len() > 2 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let number: u32 = digits.parse().ok()?;
    (number > 0).then_some((family, number))
}

fn id_name((family, number): (char, u32)) -> String {
    format!("{family}{number}")
}

/// The ids a bracket's content cites (`O6`, `H1, L1`, `A1–A7, H6`), or
/// none when the content is not a citation.
fn cited_in(content: &str) -> Option<Vec<(char, u32)>> {
    let mut ids = Vec::new();
    for item in content.split(',') {
        let item = item.trim();
        match item.split_once(['–', '-']) {
            Some((first, last)) => {
                let (family, from) = parse_id(first.trim())?;
                let (last_family, to) = parse_id(last.trim())?;
                if family != last_family || to < from {
                    return None;
                }
                ids.extend((from..=to).map(|n| (family, n)));
            }
            None => ids.push(parse_id(item)?),
        }
    }
    Some(ids)
}

/// Every id cited in `text`, with its line number.
fn citations(text: &str) -> Vec<(usize, (char, u32))> {
    let mut found = Vec::new();
    for (index, line) in text.lines().enumerate() {
        let mut rest = line;
        while let Some(open) = rest.find('[') {
            rest = &rest[open + 1..];
            let Some(close) = rest.find(']') else { break };
            let content = rest[..close].trim_end_matches('\\');
            if let Some(ids) = cited_in(content) {
                found.extend(ids.into_iter().map(|id| (index + 1, id)));
            }
        }
    }
    found
}

/// Every name `fn NAME` defines in `text`.
fn functions(text: &str, names: &mut BTreeSet<String>) {
    let mut rest = text;
    while let Some(at) = rest.find("fn ") {
        let before = rest[..at].chars().next_back();
        rest = &rest[at + 3..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let name: String = rest
            .trim_start()
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() {
            names.insert(name);
        }
    }
}

/// The spans of `cell` between backticks.
fn code_spans(cell: &str) -> impl Iterator<Item = &str> {
    cell.split('`').skip(1).step_by(2)
}

fn is_function_name(span: &str) -> bool {
    span.contains('_')
        && span.starts_with(|c: char| c.is_ascii_lowercase())
        && span
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

/// A row of the page: its id and its last cell, what proves it.
struct Row {
    line: usize,
    id: (char, u32),
    proof: String,
}

fn rows(page: &str) -> Vec<Row> {
    page.lines()
        .enumerate()
        .filter_map(|(index, line)| {
            let cells: Vec<&str> = line
                .trim()
                .strip_prefix('|')?
                .strip_suffix('|')?
                .split('|')
                .collect();
            let id = parse_id(cells.first()?.trim())?;
            Some(Row {
                line: index + 1,
                id,
                proof: cells.last()?.trim().to_owned(),
            })
        })
        .collect()
}

/// The problems with a benchmark command a row names, if it is one.
fn missing_program(root: &Path, command: &str) -> Option<String> {
    let words: Vec<&str> = command.split_whitespace().collect();
    match words.as_slice() {
        ["cargo", "run", ..] => {
            let example = words
                .iter()
                .position(|w| *w == "--example")
                .and_then(|i| words.get(i + 1));
            let Some(example) = example else {
                return Some(format!("`{command}` names no --example"));
            };
            let file = format!("{example}.rs");
            let exists = fs::read_dir(root)
                .expect("the workspace root")
                .flatten()
                .any(|dir| dir.path().join("examples").join(&file).is_file());
            (!exists).then(|| format!("`{command}`: no */examples/{file}"))
        }
        ["bash", script, ..] => {
            (!root.join(script).is_file()).then(|| format!("`{command}`: no {script}"))
        }
        _ => None,
    }
}

#[test]
fn every_cited_id_has_a_row_and_every_row_names_what_exists() {
    let root = workspace_root();
    let page =
        fs::read_to_string(root.join("CONTRACT.md")).expect("CONTRACT.md at the workspace root");
    let rows = rows(&page);
    let mut problems = Vec::new();

    // The page itself: one row per id, each family numbered from 1 without
    // a gap, and each row saying what proves it.
    let mut by_family: BTreeMap<char, Vec<u32>> = BTreeMap::new();
    for row in &rows {
        by_family.entry(row.id.0).or_default().push(row.id.1);
    }
    for family in FAMILIES.chars() {
        let mut numbers = by_family.remove(&family).unwrap_or_default();
        if numbers.is_empty() {
            problems.push(format!("CONTRACT.md: no row of the {family} family"));
            continue;
        }
        numbers.sort_unstable();
        for (expected, number) in (1..).zip(&numbers) {
            if *number != expected {
                problems.push(format!(
                    "CONTRACT.md: the {family} rows are {numbers:?}, not numbered 1.. without gaps or duplicates"
                ));
                break;
            }
        }
    }

    // What the rows name exists.
    let mut files = Vec::new();
    sources(&root, &mut files);
    files.sort();
    let mut defined = BTreeSet::new();
    for file in files
        .iter()
        .filter(|f| f.extension().is_some_and(|e| e == "rs"))
    {
        functions(&fs::read_to_string(file).unwrap_or_default(), &mut defined);
    }
    for row in &rows {
        let id = id_name(row.id);
        let mut proven = row.proof.contains("planned:");
        for span in code_spans(&row.proof) {
            if is_function_name(span) {
                proven = true;
                if !defined.contains(span) {
                    problems.push(format!(
                        "CONTRACT.md:{} ({id}) names `{span}`, but no `fn {span}` exists",
                        row.line
                    ));
                }
            } else if let Some(problem) = missing_program(&root, span) {
                problems.push(format!("CONTRACT.md:{} ({id}): {problem}", row.line));
            } else if span.starts_with("cargo run") || span.starts_with("bash ") {
                proven = true;
            }
        }
        if !proven {
            problems.push(format!(
                "CONTRACT.md:{} ({id}) names no test, no benchmark and no \"planned: issue N\"",
                row.line
            ));
        }
    }

    // Every citation in the workspace has its row.
    let known: BTreeSet<(char, u32)> = rows.iter().map(|row| row.id).collect();
    let mut citations_seen = 0;
    for file in &files {
        let text = fs::read_to_string(file).unwrap_or_default();
        for (line, id) in citations(&text) {
            citations_seen += 1;
            if !known.contains(&id) {
                let shown = file.strip_prefix(&root).unwrap_or(file).display();
                problems.push(format!(
                    "{shown}:{line} cites [{}], which has no row in CONTRACT.md",
                    id_name(id)
                ));
            }
        }
    }
    assert!(
        citations_seen > 100,
        "the scan found only {citations_seen} citations: is it reading the workspace?"
    );

    assert!(
        problems.is_empty(),
        "CONTRACT.md and the workspace disagree ({} problems):\n  {}",
        problems.len(),
        problems.join("\n  ")
    );
}

#[test]
fn citations_are_read_in_every_written_form() {
    let text = concat!(
        "plain [",
        "O6",
        "], escaped \\[",
        "H7",
        "\\], a list \\[",
        "H1, L1",
        "\\],\n",
        "a range \\[",
        "A1–A3",
        "\\], and neither a link [the docs](x) nor an index v[",
        "0",
        "]",
    );
    let ids: Vec<String> = citations(text)
        .into_iter()
        .map(|(_, id)| id_name(id))
        .collect();
    assert_eq!(ids, ["O6", "H7", "H1", "L1", "A1", "A2", "A3"]);
}
