//! Reading the guides as a reader's Markdown renderer (GitHub's) does:
//! fenced blocks with their language and the marker comment before them,
//! inline code spans, links, and the anchors headings get.

use std::path::{Path, PathBuf};

/// One Markdown file of the documentation, by its path from the repository root.
pub struct Doc {
    pub path: String,
    pub text: String,
}

impl Doc {
    pub fn read(root: &Path, path: &str) -> Doc {
        let text = std::fs::read_to_string(root.join(path)).unwrap_or_else(|e| panic!("read {path}: {e}"));
        Doc { path: path.to_owned(), text }
    }

    /// The file's folder, from the repository root ("" for the root).
    pub fn dir(&self) -> PathBuf {
        Path::new(&self.path).parent().map(Path::to_path_buf).unwrap_or_default()
    }
}

/// What the HTML comment right before a block says about it.
#[derive(Debug, Clone, PartialEq)]
pub enum Marker {
    /// `<!-- not-tested: why -->`: nothing in the block is exercised.
    NotTested(String),
    /// `<!-- checked-by: tests/NAME.rs -->`: that test compares the block's
    /// text with what the program prints.
    CheckedBy(String),
    /// `<!-- output-example: why -->`: a console block whose `$` lines are
    /// exercised as commands, and whose other lines are example output.
    OutputExample(String),
}

/// One fenced code block.
#[derive(Debug, Clone)]
pub struct Block {
    pub doc: String,
    /// 1-based line of the opening fence.
    pub line: usize,
    pub lang: String,
    /// The lines between the fences, without the fence's indentation.
    pub text: String,
    pub marker: Option<Marker>,
}

impl Block {
    pub fn at(&self) -> String {
        format!("{}:{}", self.doc, self.line)
    }
}

/// The fenced blocks of a document, in order. A fence may be indented (a
/// block inside a list item); its lines lose that indentation.
pub fn blocks(doc: &Doc) -> Vec<Block> {
    let lines: Vec<&str> = doc.text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let trimmed = lines[i].trim_start();
        if let Some(lang) = trimmed.strip_prefix("```") {
            let indent = lines[i].len() - trimmed.len();
            let start = i;
            let mut body = Vec::new();
            i += 1;
            while i < lines.len() && lines[i].trim() != "```" {
                let l = lines[i];
                let cut = l.len() - l.trim_start().len();
                body.push(&l[cut.min(indent)..]);
                i += 1;
            }
            assert!(i < lines.len(), "{}:{}: a fenced block that never closes", doc.path, start + 1);
            let marker = lines[..start].iter().rev().find(|l| !l.trim().is_empty()).and_then(|l| marker(l.trim()));
            out.push(Block {
                doc: doc.path.clone(),
                line: start + 1,
                lang: lang.trim().to_owned(),
                text: body.join("\n") + "\n",
                marker,
            });
        }
        i += 1;
    }
    out
}

fn marker(line: &str) -> Option<Marker> {
    let inner = line.strip_prefix("<!--")?.strip_suffix("-->")?.trim();
    let (kind, what) = inner.split_once(':')?;
    let what = what.trim().to_owned();
    match kind.trim() {
        "not-tested" => Some(Marker::NotTested(what)),
        "checked-by" => Some(Marker::CheckedBy(what)),
        "output-example" => Some(Marker::OutputExample(what)),
        _ => None,
    }
}

/// The document's prose: its text with fenced blocks blanked out (lines
/// kept, so positions still count) and HTML comments removed.
pub fn prose(doc: &Doc) -> String {
    let mut out = String::with_capacity(doc.text.len());
    let mut in_block = false;
    for line in doc.text.lines() {
        if line.trim_start().starts_with("```") {
            in_block = !in_block;
            out.push('\n');
            continue;
        }
        if !in_block {
            out.push_str(line);
        }
        out.push('\n');
    }
    let comment = regex::Regex::new(r"(?s)<!--.*?-->").unwrap();
    comment.replace_all(&out, "").into_owned()
}

/// Inline code spans of the prose (`like this`), whitespace folded.
pub fn code_spans(doc: &Doc) -> Vec<String> {
    let span = regex::Regex::new(r"`([^`]+)`").unwrap();
    span.captures_iter(&prose(doc)).map(|c| c[1].split_whitespace().collect::<Vec<_>>().join(" ")).collect()
}

/// Targets of the prose's links and images: `[text](target)`.
pub fn links(doc: &Doc) -> Vec<String> {
    let link = regex::Regex::new(r"\]\(([^)\s]+)\)").unwrap();
    link.captures_iter(&prose(doc)).map(|c| c[1].to_owned()).collect()
}

/// The anchors a document offers: GitHub's slug of every heading (with
/// `-1`, `-2` … for repeats) and every `<a id="…">`.
pub fn anchors(doc: &Doc) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut in_block = false;
    for line in doc.text.lines() {
        if line.trim_start().starts_with("```") {
            in_block = !in_block;
            continue;
        }
        if in_block {
            continue;
        }
        if let Some(title) = heading(line) {
            let base = slug(title);
            let mut candidate = base.clone();
            let mut n = 0;
            while out.contains(&candidate) {
                n += 1;
                candidate = format!("{base}-{n}");
            }
            out.push(candidate);
        }
    }
    let explicit = regex::Regex::new(r#"<a id="([^"]+)">"#).unwrap();
    out.extend(explicit.captures_iter(&doc.text).map(|c| c[1].to_owned()));
    out
}

/// The title of an ATX heading line (`## Title`), if it is one.
pub fn heading(line: &str) -> Option<&str> {
    let hashes = line.len() - line.trim_start_matches('#').len();
    if (1..=6).contains(&hashes) && line[hashes..].starts_with(' ') { Some(line[hashes..].trim()) } else { None }
}

/// GitHub's heading anchor: lower case, punctuation other than `-` and `_`
/// dropped, each space a hyphen.
pub fn slug(title: &str) -> String {
    title
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The rows of the Markdown tables in `text` whose header's first cell is
/// `first`: each row's cells, trimmed, `\|` kept as one cell's `|`.
pub fn table_rows(text: &str, first: &str) -> Vec<Vec<String>> {
    let mut rows = Vec::new();
    // None outside a table; Some(wanted) inside one, after its header.
    let mut state: Option<bool> = None;
    for line in text.lines() {
        let line = line.trim();
        if !line.starts_with('|') {
            state = None;
            continue;
        }
        let cells = cells(line);
        if cells.iter().all(|c| !c.is_empty() && c.chars().all(|ch| matches!(ch, '-' | ':'))) {
            continue;
        }
        match state {
            None => state = Some(cells.first().map(String::as_str) == Some(first)),
            Some(true) => rows.push(cells),
            Some(false) => {}
        }
    }
    rows
}

fn cells(line: &str) -> Vec<String> {
    let inner = line.trim().trim_start_matches('|').trim_end_matches('|');
    let mut cells = vec![String::new()];
    let mut chars = inner.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'|') => {
                cells.last_mut().unwrap().push('|');
                chars.next();
            }
            '|' => cells.push(String::new()),
            c => cells.last_mut().unwrap().push(c),
        }
    }
    cells.iter().map(|c| c.trim().to_owned()).collect()
}
