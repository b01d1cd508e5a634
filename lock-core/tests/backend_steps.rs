//! The table of `LockBackend`'s methods in the crate docs (README.md,
//! "Writing a new backend") lists every method of the trait, and says
//! which are required, as `src/backend.rs` declares them: a method added
//! to the trait, or given a default, fails here until the table says so.

use std::collections::BTreeMap;

const README: &str = include_str!("../README.md");
const BACKEND: &str = include_str!("../src/backend.rs");

/// The trait's methods, `true` for those without a default body.
fn trait_methods() -> BTreeMap<String, bool> {
    let start = BACKEND
        .find("pub trait LockBackend")
        .expect("src/backend.rs declares `pub trait LockBackend`");
    let body = &BACKEND[start..];
    let body = &body[..body.find("\n}\n").expect("the trait's closing brace")];
    let mut methods = BTreeMap::new();
    for (at, _) in body.match_indices("\n    ") {
        let line = &body[at + 5..];
        let Some(rest) = line
            .strip_prefix("fn ")
            .or_else(|| line.strip_prefix("async fn "))
        else {
            continue;
        };
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let end = rest.find([';', '{']).expect("a method's signature ends");
        methods.insert(name, rest.as_bytes()[end] == b';');
    }
    methods
}

/// The README's table: method name, `true` for "required".
fn documented_methods() -> BTreeMap<String, bool> {
    let start = README
        .find("\n# Writing a new backend")
        .expect("README.md has \"# Writing a new backend\"");
    let section = &README[start + 1..];
    let section = &section[..section.find("\n# ").unwrap_or(section.len())];
    let mut methods = BTreeMap::new();
    for line in section.lines().filter(|line| line.starts_with("| [`")) {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let name = cells[1]
            .split('`')
            .nth(1)
            .expect("a method name in backticks");
        let required = match cells[2] {
            "required" => true,
            "optional" => false,
            other => panic!("`{name}` is neither required nor optional: {other:?}"),
        };
        assert!(
            methods.insert(name.to_owned(), required).is_none(),
            "`{name}` is listed twice"
        );
    }
    methods
}

#[test]
fn the_table_of_steps_lists_every_method_of_the_trait() {
    let declared = trait_methods();
    let documented = documented_methods();
    assert!(
        declared.len() >= 8,
        "the trait's methods were not read: {declared:?}"
    );
    let kind = |required: bool| if required { "required" } else { "optional" };
    let mut problems = Vec::new();
    for (name, required) in &declared {
        match documented.get(name) {
            None => problems.push(format!(
                "`{name}` ({}) is missing from the table",
                kind(*required)
            )),
            Some(said) if said != required => problems.push(format!(
                "`{name}` is {} in the trait, {} in the table",
                kind(*required),
                kind(*said)
            )),
            Some(_) => {}
        }
    }
    for name in documented
        .keys()
        .filter(|name| !declared.contains_key(*name))
    {
        problems.push(format!("`{name}` is in the table but not in the trait"));
    }
    assert!(
        problems.is_empty(),
        "README.md's table of LockBackend's methods (\"Writing a new backend\") and src/backend.rs disagree:\n  {}",
        problems.join("\n  ")
    );
}
