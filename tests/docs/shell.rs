//! Enough of POSIX shell syntax to read the guides' `sh` blocks as a shell
//! would split them: line continuations, comments, quotes, `$(…)`,
//! pipelines and lists, redirections, assignments and here-documents. No
//! expansion happens: `$TOKEN` stays `$TOKEN`.

/// One simple command: `NAME=value … word … > file`.
#[derive(Debug, Clone, Default)]
pub struct Command {
    /// 1-based line of the block where the command starts.
    pub line: usize,
    pub assignments: Vec<(String, String)>,
    pub words: Vec<String>,
    /// `(operator, target)`: `>`, `>>`, `<`, `2>`.
    pub redirects: Vec<(String, String)>,
    /// The body of a here-document fed to this command (`<<'EOF'`).
    pub heredoc: Option<String>,
}

impl Command {
    pub fn program(&self) -> Option<&str> {
        self.words.first().map(String::as_str)
    }

    /// The value of `--name VALUE` or `--name=VALUE` (also `-n VALUE` for
    /// a short `name`).
    pub fn option(&self, name: &str) -> Option<&str> {
        let mut words = self.words.iter();
        while let Some(w) = words.next() {
            if w == name {
                return words.next().map(String::as_str);
            }
            if let Some(v) = w.strip_prefix(name).and_then(|rest| rest.strip_prefix('=')) {
                return Some(v);
            }
        }
        None
    }

    /// Every value given with a repeatable option such as `--set`.
    pub fn options(&self, name: &str) -> Vec<&str> {
        let mut out = Vec::new();
        let mut words = self.words.iter();
        while let Some(w) = words.next() {
            if w == name {
                out.extend(words.next().map(String::as_str));
            } else if let Some(v) = w.strip_prefix(name).and_then(|rest| rest.strip_prefix('=')) {
                out.push(v);
            }
        }
        out
    }

    /// The words that are not options or option values, after the program:
    /// `valued` names the options that take a value.
    pub fn operands(&self, valued: &[&str]) -> Vec<&str> {
        let mut out = Vec::new();
        let mut words = self.words.iter().skip(1);
        while let Some(w) = words.next() {
            if valued.contains(&w.as_str()) {
                words.next();
            } else if !w.starts_with('-') {
                out.push(w.as_str());
            }
        }
        out
    }

    /// The options used (`--flag`, `-f`), without their values.
    pub fn flags(&self) -> Vec<&str> {
        self.words
            .iter()
            .skip(1)
            .filter(|w| w.starts_with('-') && w.len() > 1)
            .map(|w| w.split_once('=').map_or(w.as_str(), |(f, _)| f))
            .collect()
    }
}

/// The commands of a script, in order. Commands of a pipeline or a list
/// (`a | b`, `a && b`, `a &`) come out one by one; `$(…)` inside a word
/// stays in the word (see [`substitutions`]).
pub fn parse(script: &str) -> Vec<Command> {
    let mut out = Vec::new();
    let lines: Vec<&str> = script.lines().collect();
    let mut i = 0;
    while i < lines.len() {
        let start = i;
        let mut logical = String::new();
        loop {
            let line = lines[i];
            i += 1;
            match line.strip_suffix('\\') {
                Some(head) if i < lines.len() => {
                    logical.push_str(head);
                    logical.push(' ');
                }
                _ => {
                    logical.push_str(line);
                    break;
                }
            }
        }
        let mut commands = split(&logical, start + 1);
        if let Some(delimiter) = commands.iter().find_map(|c| c.redirects.iter().find(|(op, _)| op == "<<")) {
            let delimiter = delimiter.1.clone();
            let mut body = String::new();
            while i < lines.len() && lines[i].trim() != delimiter {
                body.push_str(lines[i]);
                body.push('\n');
                i += 1;
            }
            assert!(i < lines.len(), "line {}: a here-document without its closing {delimiter}", start + 1);
            i += 1;
            for c in commands.iter_mut().filter(|c| c.redirects.iter().any(|(op, _)| op == "<<")) {
                c.heredoc = Some(body.clone());
            }
        }
        out.append(&mut commands);
    }
    out
}

/// The commands inside `$(…)` of a word, e.g. `cat FILE` in `$(cat FILE)`.
pub fn substitutions(word: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = word;
    while let Some(start) = rest.find("$(") {
        let after = &rest[start + 2..];
        let mut depth = 1;
        let mut end = None;
        for (j, c) in after.char_indices() {
            match c {
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth == 0 {
                        end = Some(j);
                        break;
                    }
                }
                _ => {}
            }
        }
        let end = end.unwrap_or_else(|| panic!("an unclosed $( in {word:?}"));
        out.push(after[..end].to_owned());
        rest = &after[end + 1..];
    }
    out
}

#[derive(Debug, PartialEq)]
enum Token {
    Word(String),
    Op(String),
}

/// Splits one logical line into simple commands.
fn split(line: &str, number: usize) -> Vec<Command> {
    let mut commands = Vec::new();
    let mut current = Command { line: number, ..Command::default() };
    let mut tokens = tokens(line).into_iter().peekable();
    while let Some(token) = tokens.next() {
        match token {
            Token::Op(op) if matches!(op.as_str(), ">" | ">>" | "<" | "2>" | "<<") => match tokens.next() {
                Some(Token::Word(target)) => current.redirects.push((op, target)),
                other => panic!("line {number}: {op} followed by {other:?}"),
            },
            Token::Op(_) => {
                if !current.words.is_empty() || !current.assignments.is_empty() {
                    commands.push(std::mem::replace(&mut current, Command { line: number, ..Command::default() }));
                }
            }
            Token::Word(w) => {
                let assignment = current.words.is_empty()
                    && w.split_once('=').is_some_and(|(name, _)| {
                        !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                    });
                match (assignment, w.split_once('=')) {
                    (true, Some((name, value))) => current.assignments.push((name.to_owned(), value.to_owned())),
                    _ => current.words.push(w),
                }
            }
        }
    }
    if !current.words.is_empty() || !current.assignments.is_empty() {
        commands.push(current);
    }
    commands
}

fn tokens(line: &str) -> Vec<Token> {
    let mut out = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut chars = line.chars().peekable();
    let flush = |word: &mut String, in_word: &mut bool, out: &mut Vec<Token>| {
        if *in_word {
            out.push(Token::Word(std::mem::take(word)));
            *in_word = false;
        }
    };
    while let Some(c) = chars.next() {
        match c {
            '#' if !in_word => break,
            ' ' | '\t' => flush(&mut word, &mut in_word, &mut out),
            '\'' => {
                in_word = true;
                for q in chars.by_ref() {
                    if q == '\'' {
                        break;
                    }
                    word.push(q);
                }
            }
            '"' => {
                in_word = true;
                while let Some(q) = chars.next() {
                    match q {
                        '"' => break,
                        '\\' => word.extend(chars.next()),
                        q => word.push(q),
                    }
                }
            }
            '\\' => {
                in_word = true;
                word.extend(chars.next());
            }
            '$' if chars.peek() == Some(&'(') => {
                in_word = true;
                word.push('$');
                let mut depth = 0;
                for q in chars.by_ref() {
                    word.push(q);
                    match q {
                        '(' => depth += 1,
                        ')' => {
                            depth -= 1;
                            if depth == 0 {
                                break;
                            }
                        }
                        _ => {}
                    }
                }
            }
            '2' if !in_word && chars.peek() == Some(&'>') => {
                chars.next();
                out.push(Token::Op("2>".to_owned()));
            }
            '|' | '&' | ';' | '>' | '<' => {
                flush(&mut word, &mut in_word, &mut out);
                let mut op = c.to_string();
                if let Some(&next) = chars.peek() {
                    if (next == c && c != ';') || (c == '>' && next == '>') {
                        op.push(next);
                        chars.next();
                    }
                }
                out.push(Token::Op(op));
            }
            c => {
                in_word = true;
                word.push(c);
            }
        }
    }
    flush(&mut word, &mut in_word, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_pipelines_quotes_and_heredocs_split_as_a_shell_splits_them() {
        let script = "TOKEN=$(cat /run/t) # the token\n\
                      curl -X POST -H \"Authorization: Bearer $TOKEN\" \\\n  'http://h:9090/purge?a=b&c=d' &\n\
                      kubectl get secret s -o jsonpath='{.data.token}' | base64 -d > admin-token\n\
                      cat > f.json <<'JSON'\n{\"a\": 1}\nJSON\n\
                      aws s3api x --bucket b";
        let c = parse(script);
        assert_eq!(c.len(), 6, "{c:#?}");
        assert_eq!(c[0].assignments, vec![("TOKEN".to_owned(), "$(cat /run/t)".to_owned())]);
        assert_eq!(substitutions(&c[0].assignments[0].1), vec!["cat /run/t"]);
        assert_eq!(
            c[1].words,
            ["curl", "-X", "POST", "-H", "Authorization: Bearer $TOKEN", "http://h:9090/purge?a=b&c=d"]
        );
        assert_eq!((c[1].line, c[1].option("-X")), (2, Some("POST")));
        assert_eq!(c[2].words, ["kubectl", "get", "secret", "s", "-o", "jsonpath={.data.token}"]);
        assert_eq!(c[3].redirects, [(">".to_owned(), "admin-token".to_owned())]);
        assert_eq!(c[4].heredoc.as_deref(), Some("{\"a\": 1}\n"));
        assert_eq!(c[5].option("--bucket"), Some("b"));
    }
}
