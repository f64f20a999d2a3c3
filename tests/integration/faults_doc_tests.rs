//! `docs/FAULTS.md` stays honest: every row of its fault tables names tests that exist (a
//! `#[test] fn` in the named file, the file compiled into its test binary) and an exit code from
//! the documented set. The doc's "Test references" section describes the format checked here.

use std::path::{Path, PathBuf};

const DOC: &str = "docs/FAULTS.md";

/// The header of a fault table; tables with another header are not checked.
const HEADER: [&str; 4] = ["Input / fault", "Exit", "First line of the message", "Test"];

/// The process exit codes a row may give (src/exit.rs, and 130 for Ctrl-C), or "—" for an error
/// whose test checks it at library level without asserting a code.
const EXIT_CELLS: [&str; 7] = ["0", "1", "2", "3", "4", "130", "—"];

/// A section whose table must stay a fault table (its header spelled as above), so that its
/// rows are checked.
const ADDITIONS: &str = "## Reliability: mapped weights, sizes, memory limits, the context, checksums";

/// Fewer rows than this means the parser lost the tables, not that the faults went away.
const MIN_ROWS: usize = 80;

/// One table row: its 1-based line in the doc and its cells.
struct Row {
    line: usize,
    cells: Vec<String>,
}

/// The cells of a table line, split on `|` not escaped as `\|`.
fn cells(line: &str) -> Vec<String> {
    let inner = line.trim().trim_start_matches('|');
    let inner = inner.strip_suffix('|').filter(|s| !s.ends_with('\\')).unwrap_or(inner);
    let mut out = vec![String::new()];
    let mut chars = inner.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'|') => {
                out.last_mut().unwrap().push('|');
                chars.next();
            }
            '|' => out.push(String::new()),
            _ => out.last_mut().unwrap().push(c),
        }
    }
    out.into_iter().map(|c| c.trim().to_owned()).collect()
}

/// The rows of every fault table of `doc`.
fn fault_rows(doc: &str) -> Vec<Row> {
    let lines: Vec<&str> = doc.lines().collect();
    let mut rows = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let is_header = lines[i].trim_start().starts_with('|') && cells(lines[i]) == HEADER;
        if !is_header {
            i += 1;
            continue;
        }
        i += 2; // the header and its |---| line
        while i < lines.len() && lines[i].trim_start().starts_with('|') {
            rows.push(Row { line: i + 1, cells: cells(lines[i]) });
            i += 1;
        }
    }
    rows
}

/// Whether `name` is a Rust identifier of a test function (lower case, digits, `_`).
fn is_fn_name(name: &str) -> bool {
    !name.is_empty() && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

/// The source file a test reference points into, and the function name:
/// `checkpoint_tests::name` is `tests/integration/checkpoint_tests.rs` (registered in its
/// `main.rs`); `src/config/tests.rs::name` and `kernels/src/error.rs::name` are lib unit tests, by path
/// from the repository root.
fn resolve(reference: &str, root: &Path) -> Result<(PathBuf, String), String> {
    let (file, name) = reference.rsplit_once("::").ok_or_else(|| format!("`{reference}` is not FILE::TEST"))?;
    if !is_fn_name(name) {
        return Err(format!("`{reference}`: {name:?} is not a test function name"));
    }
    if file.contains('/') {
        let lib = (file.starts_with("src/") || file.starts_with("kernels/src/")) && file.ends_with(".rs");
        if !lib || file.contains("..") {
            return Err(format!("`{reference}`: a lib test is src/PATH.rs::TEST or kernels/src/PATH.rs::TEST"));
        }
        return Ok((root.join(file), name.to_owned()));
    }
    if !is_fn_name(file) {
        return Err(format!("`{reference}`: {file:?} is not an integration test module"));
    }
    let main = std::fs::read_to_string(root.join("tests/integration/main.rs")).unwrap_or_default();
    if !main.lines().any(|l| l.trim() == format!("mod {file};")) {
        return Err(format!("`{reference}`: tests/integration/main.rs has no `mod {file};`"));
    }
    Ok((root.join("tests/integration").join(format!("{file}.rs")), name.to_owned()))
}

/// Whether `source` defines `fn name(` under a `#[test]` attribute (other attributes and
/// comments may sit between them).
fn defines_test(source: &str, name: &str) -> bool {
    let lines: Vec<&str> = source.lines().collect();
    let def = format!("fn {name}(");
    lines.iter().enumerate().any(|(i, line)| {
        let line = line.trim_start();
        if !(line.starts_with(&def) || line.strip_prefix("pub ").is_some_and(|l| l.starts_with(&def))) {
            return false;
        }
        lines[..i]
            .iter()
            .rev()
            .map(|l| l.trim())
            .take_while(|l| l.starts_with("#[") || l.starts_with("//"))
            .any(|l| l == "#[test]")
    })
}

/// Every problem of the fault tables of `doc`, one line each; `root` is the repository root.
fn problems(doc: &str, root: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for row in fault_rows(doc) {
        let mut bad = |what: String| out.push(format!("{DOC}:{}: {what}", row.line));
        let [input, exit, message, tests] = &row.cells[..] else {
            bad(format!("{} cells, the table has 4", row.cells.len()));
            continue;
        };
        if input.is_empty() || message.is_empty() {
            bad("empty input or message cell".to_owned());
        }
        if !EXIT_CELLS.contains(&exit.as_str()) {
            bad(format!("exit cell {exit:?} is not one of {EXIT_CELLS:?}"));
        }
        let pieces: Vec<&str> = tests.split('`').collect();
        let references: Vec<&str> = pieces.iter().skip(1).step_by(2).copied().collect();
        let between_ok =
            pieces.len() % 2 == 1 && pieces.iter().step_by(2).all(|p| p.chars().all(|c| c == ',' || c.is_whitespace()));
        if references.is_empty() || !between_ok {
            bad(format!("test cell {tests:?} is not a comma-separated list of `FILE::TEST`"));
        }
        for reference in references {
            match resolve(reference, root) {
                Err(e) => bad(e),
                Ok((path, name)) => match std::fs::read_to_string(&path) {
                    Err(e) => bad(format!("`{reference}`: cannot read {}: {e}", path.display())),
                    Ok(source) if !defines_test(&source, &name) => {
                        bad(format!("`{reference}`: no #[test] fn {name}( in {}", path.display()))
                    }
                    Ok(_) => {}
                },
            }
        }
    }
    out
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn faults_doc_every_row_names_existing_tests_and_a_documented_exit_code() {
    let doc = std::fs::read_to_string(root().join(DOC)).unwrap();
    let found = problems(&doc, root());
    assert!(found.is_empty(), "{} problems:\n{}", found.len(), found.join("\n"));
    let rows = fault_rows(&doc).len();
    assert!(rows >= MIN_ROWS, "only {rows} rows in the fault tables of {DOC}: was a table header changed?");
    let additions = doc.find(ADDITIONS).expect("the reliability section");
    assert!(
        doc[additions..].lines().any(|l| l.trim_start().starts_with('|') && cells(l) == HEADER),
        "the reliability section has no fault table header"
    );
}

#[test]
fn faults_doc_checker_refuses_missing_tests_and_unknown_codes() {
    let doc = "\
| Input / fault | Exit | First line of the message | Test |
|---|---|---|---|
| good | 3 | `a \\| b` | `checkpoint_tests::truncated_shard_is_a_data_error_naming_shard_and_tensor`, `src/config/tests.rs::read_failures_exit_4_and_refusals_exit_2` |
| missing test | 2 | msg | `cli_tests::no_such_test_exists` |
| helper, not a test | 2 | msg | `checkpoint_tests::copy_tiny` |
| unregistered module | 2 | msg | `nowhere_tests::a_test` |
| missing lib test | — | msg | `src/config/tests.rs::no_such_test_exists` |
| outside the crate | — | msg | `tests/integration/cli_tests.rs::help_and_version_exit_0` |
| bad code | 5 | msg | `cli_tests::help_and_version_exit_0` |
| no test | 2 | msg | none |
| three cells | 2 | msg |
";
    let found = problems(doc, root());
    let expect = [
        (4, "no #[test] fn no_such_test_exists("),
        (5, "no #[test] fn copy_tiny("),
        (6, "has no `mod nowhere_tests;`"),
        (7, "no #[test] fn no_such_test_exists("),
        (8, "a lib test is src/PATH.rs::TEST"),
        (9, "exit cell \"5\""),
        (10, "is not a comma-separated list"),
        (11, "3 cells, the table has 4"),
    ];
    for (line, needle) in expect {
        let prefix = format!("{DOC}:{line}: ");
        assert!(
            found.iter().any(|p| p.starts_with(&prefix) && p.contains(needle)),
            "line {line} should be refused for {needle:?}; found:\n{}",
            found.join("\n")
        );
    }
    assert_eq!(found.len(), expect.len(), "{}", found.join("\n"));
    assert_eq!(fault_rows(doc)[0].cells[2], "`a | b`");
}
