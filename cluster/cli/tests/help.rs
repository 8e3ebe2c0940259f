//! README's command table and the binary's help agree: every subcommand `lockstep
//! --help` lists has a row (`| `lockstep NAME ...`), every row names a subcommand, and
//! every option a row mentions is in that subcommand's `--help` (or a nested one's).

use std::collections::BTreeSet;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_lockstep");

fn help(args: &[&str]) -> String {
    let o = Command::new(BIN)
        .args(args)
        .arg("--help")
        .output()
        .expect("run lockstep");
    assert_eq!(o.status.code(), Some(0), "{args:?} --help");
    String::from_utf8(o.stdout).expect("utf-8 help")
}

/// The subcommands a help text lists under `Commands:` (without `help`).
fn commands(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter(|l| l.starts_with("  ") && !l.starts_with("   "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(String::from)
        .collect()
}

/// A subcommand's help and its nested subcommands' helps, together.
fn whole_help(command: &str) -> String {
    let mut text = help(&[command]);
    for nested in commands(&text.clone()) {
        text.push_str(&help(&[command, &nested]));
    }
    text
}

/// README's command table: each row's subcommands (a row may name several, `lockstep
/// import ...` / `lockstep export ...`) and the row's text.
fn readme_rows() -> Vec<(Vec<String>, String)> {
    readme_table(
        |l| l.starts_with("| `lockstep "),
        |cell| {
            cell.split("`lockstep ")
                .skip(1)
                .filter_map(|rest| rest.split([' ', '`']).next())
                .map(String::from)
                .collect()
        },
    )
}

/// README's rows of options several subcommands share (`| `--model DIR` on `sim`,
/// `run`, `serve` | ...`): the subcommands after ` on ` and the row's text.
fn readme_option_rows() -> Vec<(Vec<String>, String)> {
    readme_table(
        |l| l.starts_with("| `--") && l.contains("` on `"),
        |cell| {
            let after_on = cell.split("` on ").nth(1).unwrap_or_default();
            after_on
                .split('`')
                .skip(1)
                .step_by(2)
                .map(String::from)
                .collect()
        },
    )
}

/// The README table rows `keep` picks, each with the subcommands `names` reads from its
/// first cell.
fn readme_table(
    keep: impl Fn(&str) -> bool,
    names: impl Fn(&str) -> Vec<String>,
) -> Vec<(Vec<String>, String)> {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md"))
        .expect("README.md");
    readme
        .lines()
        .filter(|l| keep(l))
        .map(|l| {
            let first_cell = l[1..].split(" | ").next().unwrap_or_default();
            (names(first_cell), l.to_string())
        })
        .collect()
}

/// The `--options` a README row names.
fn options_of(row: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let bytes = row.as_bytes();
    let mut i = 0;
    while let Some(at) = row[i..].find("--") {
        let start = i + at;
        let mut end = start + 2;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'-') {
            end += 1;
        }
        // `--features` is cargo's (a row says how to build), not the subcommand's.
        if end > start + 2
            && bytes[start + 2].is_ascii_alphabetic()
            && &row[start..end] != "--features"
        {
            out.insert(row[start..end].to_string());
        }
        i = end.max(start + 2);
    }
    out
}

#[test]
fn readme_command_table_matches_the_help() {
    let top = help(&[]);
    let listed: BTreeSet<String> = commands(&top).into_iter().collect();
    assert!(listed.contains("sim"), "{top}");
    let rows = readme_rows();
    let documented: BTreeSet<String> = rows.iter().flat_map(|(n, _)| n.clone()).collect();
    let missing: Vec<_> = listed.difference(&documented).collect();
    assert!(
        missing.is_empty(),
        "subcommands without a row in README's command table: {missing:?}"
    );
    let unknown: Vec<_> = documented.difference(&listed).collect();
    assert!(
        unknown.is_empty(),
        "README rows for subcommands `lockstep --help` does not list: {unknown:?}"
    );
    for (names, row) in &rows {
        let text: String = names.iter().map(|n| whole_help(n)).collect();
        check_options(names, &text, row);
    }
    // A row of options several subcommands share: each of them takes every option.
    let shared = readme_option_rows();
    assert!(!shared.is_empty(), "README's `--model DIR` on ... row");
    for (names, row) in &shared {
        for name in names {
            check_options(std::slice::from_ref(name), &whole_help(name), row);
        }
    }
}

/// Every option `row` names is in `text`, the help of the row's subcommands.
fn check_options(names: &[String], text: &str, row: &str) {
    for option in options_of(row) {
        assert!(
            text.contains(&option),
            "README says `lockstep {names:?}` takes {option}; its --help does not:\n{row}"
        );
    }
}
