//! The messages the guides quote are the crate's: every error message in a guide's
//! "the message" column, every log line quoted next to its level (`WARN`, `ERROR`, `INFO`)
//! and every line of a `text` block that the crate logs is found in `src/`, its variable
//! parts (addresses, numbers, names in backticks) set aside. A message reworded in the code
//! fails this test until the guides say it too.

use std::path::Path;

/// Messages that the guides quote from other crates (redis-rs' cluster client).
const FOREIGN: &[&str] = &["async cluster client recovery"];

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every `.rs` file under `dir`, its string literals' line continuations joined as the
/// compiler joins them.
fn sources(dir: &Path, into: &mut String) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .expect("src")
        .map(|e| e.expect("entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            sources(&path, into);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let text = read(&path);
            let mut lines = text.split('\n').peekable();
            while let Some(line) = lines.next() {
                // Comments quote messages too: only code counts.
                if line.trim_start().starts_with("//") {
                    continue;
                }
                match line.strip_suffix('\\') {
                    Some(joined) => {
                        into.push_str(joined);
                        if let Some(next) = lines.peek_mut() {
                            *next = next.trim_start();
                        }
                    }
                    None => {
                        into.push_str(line);
                        into.push('\n');
                    }
                }
            }
        }
    }
}

/// The guides' paragraphs, each on one line (a table row stays a line of its own).
fn paragraphs(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in text.lines() {
        if line.trim().is_empty() || line.starts_with('|') || line.starts_with("```") {
            if !current.is_empty() {
                out.push(std::mem::take(&mut current));
            }
            if !line.trim().is_empty() {
                out.push(line.to_owned());
            }
        } else {
            if !current.is_empty() {
                current.push(' ');
            }
            current.push_str(line.trim());
        }
    }
    out.extend((!current.is_empty()).then_some(current));
    out
}

/// The spans between backticks of `text`.
fn code_spans(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

/// What a guide quotes as the crate's messages: (where, message).
fn quoted(name: &str, text: &str) -> Vec<(String, String)> {
    let mut found = Vec::new();
    let mut message_column = None;
    let mut in_text = false;
    for paragraph in paragraphs(text) {
        if paragraph.starts_with("```") {
            in_text = paragraph.trim() == "```text" && !in_text;
            continue;
        }
        if in_text {
            // A log line: `LEVEL target: message fields`.
            for level in [" WARN ", " INFO ", " ERROR "] {
                let line = format!(" {paragraph}");
                if let Some((_, rest)) = line.split_once(level)
                    && let Some((target, message)) = rest.split_once(": ")
                    && target.starts_with("tower_lock")
                {
                    let message = message.split(" reason=").next().unwrap_or(message);
                    found.push((format!("{name} text block"), message.to_owned()));
                }
            }
            continue;
        }
        if let Some(cells) = paragraph.strip_prefix('|') {
            let cells: Vec<&str> = cells.split('|').map(str::trim).collect();
            if let Some(column) = cells.iter().position(|c| c.starts_with("the message")) {
                message_column = Some(column);
            } else if let Some(column) = message_column
                && let Some(cell) = cells.get(column)
                && !cell.starts_with("---")
                && !cell.contains("](")
            {
                // The message, then its cause as `{err:#}` would print it.
                for message in cell.split(", caused by: ") {
                    found.push((format!("{name} table"), message.to_owned()));
                }
            }
            continue;
        }
        message_column = None;
        // A log line quoted next to its level.
        if ["WARN", "ERROR", "INFO"]
            .iter()
            .any(|l| paragraph.contains(l))
        {
            for span in code_spans(&paragraph) {
                let looks_like_a_message = span.starts_with(|c: char| c.is_ascii_lowercase())
                    && span.matches(' ').count() >= 2
                    && !span.contains("::")
                    && !span.contains('=');
                if looks_like_a_message && !FOREIGN.iter().any(|f| span.starts_with(f)) {
                    found.push((format!("{name} log line"), span.to_owned()));
                }
            }
        }
    }
    found
}

/// Whether `word` of a quoted message is an example's value rather than the crate's text:
/// a name in backticks, an address or a number, an elision, a command or an error kind
/// (`PUBLISH`, `UnknownIssuer`), a `role:slave` pair, a dash.
fn variable(word: &str) -> bool {
    let letters: Vec<char> = word.chars().filter(|c| c.is_alphabetic()).collect();
    word.contains('`')
        || word.contains('{')
        || word.contains("...")
        || word.contains('…')
        || word.contains(':') && !word.ends_with(':')
        || word.chars().any(|c| c.is_ascii_digit())
        || letters.is_empty()
        || letters.len() >= 2 && letters.iter().all(|c| c.is_uppercase())
        || letters.iter().skip(1).any(|c| c.is_uppercase()) && letters[0].is_uppercase()
}

/// Whether `words` are on `line` as at most `pieces` runs with a placeholder of the
/// format string (`{name}`, `{}s`) between two runs, where the quoted message has the
/// value formatted in (one word); `after` when the first run must follow a placeholder.
fn covered(words: &[&str], line: &str, pieces: usize, after: bool) -> bool {
    if words.is_empty() {
        return true;
    }
    if pieces == 0 {
        return false;
    }
    (1..=words.len()).rev().any(|end| {
        let piece = words[..end].join(" ");
        let piece = piece.trim_end_matches(['.', ',', ';', ':']);
        let rest = &words[end..];
        if piece.len() < 4 {
            return false;
        }
        let at: Vec<usize> = line
            .match_indices(piece)
            .map(|(i, _)| i)
            .filter(|&i| !after || last_token(&line[..i]).contains('}'))
            .collect();
        if at.is_empty() {
            return false;
        }
        if rest.is_empty() {
            return true;
        }
        let placeholder_next = at.iter().any(|&i| {
            let next = line[i + piece.len()..].trim_start();
            next.split(' ').next().is_some_and(|t| t.contains('{'))
        });
        placeholder_next && covered(&rest[1..], line, pieces - 1, true)
    })
}

/// The last space-separated token of `text`.
fn last_token(text: &str) -> &str {
    text.trim_end().rsplit(' ').next().unwrap_or_default()
}

/// Whether a literal part of a quoted message is the crate's: on one line of the code as
/// it is, or formatted there from up to three runs (a name formatted in before or between
/// them).
fn in_code(part: &str, code: &str) -> bool {
    let words: Vec<&str> = part.split(' ').collect();
    let on_one_line = |words: &[&str]| {
        code.lines().filter(|line| line.contains('"')).any(|line| {
            (0..words.len().min(4)).any(|skip| covered(&words[skip..], line, 3, skip > 0))
        })
    };
    // Or a message whose end is a value formatted in last (`may not {right}`), that value
    // the start of another literal (`"use the database`).
    on_one_line(&words)
        || (1..words.len()).any(|k| {
            let (head, tail) = (words[..k].join(" "), words[k..].join(" "));
            let ends_in_a_value = code.lines().any(|line| {
                line.match_indices(&format!("{head} {{")).any(|(i, _)| {
                    line[i..]
                        .split_once('}')
                        .is_some_and(|(_, r)| r.starts_with('"'))
                })
            });
            ends_in_a_value && code.contains(&format!("\"{}", tail.trim_end_matches(['.', ','])))
        })
}

/// The literal parts of a quoted message: what is left between its variable parts.
fn literal_parts(message: &str) -> Vec<String> {
    let mut parts = Vec::new();
    let mut current = String::new();
    let mut in_code = false;
    for word in message.split(' ') {
        let variable = variable(word);
        if variable || in_code {
            in_code ^= word.matches('`').count() % 2 == 1;
            if current.len() >= 12 {
                parts.push(current.trim().to_owned());
            }
            current.clear();
        } else {
            current.push_str(word);
            current.push(' ');
        }
    }
    if current.trim().len() >= 12 {
        parts.push(current.trim().to_owned());
    }
    parts
}

#[test]
fn every_message_a_guide_quotes_is_in_the_code() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut code = String::new();
    sources(&root.join("src"), &mut code);
    let mut guides = vec![root.join("README.md")];
    let mut docs: Vec<_> = std::fs::read_dir(root.join("docs"))
        .expect("docs")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    guides.extend(docs);
    let mut checked = 0;
    let mut missing = Vec::new();
    for guide in &guides {
        let name = guide
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        for (place, message) in quoted(&name, &read(guide)) {
            for part in literal_parts(&message) {
                checked += 1;
                if !in_code(&part, &code) {
                    missing.push(format!("{place}: {part:?} (of {message:?})"));
                }
            }
        }
    }
    assert!(
        checked > 40,
        "only {checked} quoted parts found: is the parser right?"
    );
    assert!(
        missing.is_empty(),
        "quoted in a guide, not in src/:\n{}",
        missing.join("\n")
    );
}
