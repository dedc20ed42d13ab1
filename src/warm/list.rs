//! The warm list: the config's `[[warm]]` and the lines of
//! `cache.warm_file`, read again whenever the file changes (a Kubernetes
//! ConfigMap that a pipeline or a controller writes is swapped in place
//! through a symlink, so the stamp follows the path). A bad line is
//! reported with its number and skipped; the other lines apply.
//!
//! A file may be read while it is being written: a last line without its
//! newline (`team/app:v1` of `team/app:v10`) is not taken as an image
//! until it ends, and the loop applies a changed file only once two reads
//! in a row agree (see `crate::warm`).

use std::path::Path;
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use crate::config::{UpstreamConfig, WarmImage, parse_warm_file};

/// Largest warm file read; a longer one is refused whole (and the list
/// read before it kept), as a file that size is not a list of images.
pub const MAX_WARM_FILE: u64 = 1 << 20;

/// A bad line of the warm file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BadLine {
    /// From 1.
    pub line: usize,
    pub message: String,
}

/// The warm file as last read.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileReport {
    pub path: String,
    /// Images its good lines list.
    pub images: usize,
    pub bad_lines: Vec<BadLine>,
    /// Why it could not be read, when it could not (its images from the
    /// last good read are kept, or none if it is missing).
    pub error: Option<String>,
    /// The number of a last line that does not end with a newline yet:
    /// not read until it does (it may be half written).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unterminated_line: Option<usize>,
}

/// What reading the warm file found, before it is parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Raw {
    Missing,
    TooLarge,
    Unreadable(String),
    Bytes(Vec<u8>),
}

/// Reads the warm file's bytes (blocking: call on the blocking pool).
pub fn read_raw(path: &Path) -> Raw {
    match std::fs::metadata(path) {
        Ok(meta) if meta.len() > MAX_WARM_FILE => return Raw::TooLarge,
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Raw::Missing,
        Err(_) => {}
    }
    match std::fs::read(path) {
        Ok(bytes) if bytes.len() as u64 > MAX_WARM_FILE => Raw::TooLarge,
        Ok(bytes) => Raw::Bytes(bytes),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Raw::Missing,
        Err(e) => Raw::Unreadable(e.to_string()),
    }
}

/// What identifies a version of a file on disk: length, modification time
/// and inode of what the path resolves to now (`None`: no file).
pub type Stamp = Option<(u64, SystemTime, u64)>;

pub fn stamp(path: &Path) -> Stamp {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.len(), meta.modified().ok()?, meta.ino()))
}

/// Reads the warm file (blocking: call on the blocking pool). `known` are
/// the config's images (a line repeating one is reported and skipped).
/// `None` images when the file could not be read for another reason than
/// being missing: the caller keeps what it had.
pub fn read_file(
    path: &Path,
    upstreams: &[UpstreamConfig],
    known: &[WarmImage],
) -> (Option<Vec<WarmImage>>, FileReport) {
    parse(path, &read_raw(path), upstreams, known)
}

/// The images of a warm file read as `raw` (see [`read_file`]). A last
/// line without a newline is left out and reported.
pub fn parse(
    path: &Path,
    raw: &Raw,
    upstreams: &[UpstreamConfig],
    known: &[WarmImage],
) -> (Option<Vec<WarmImage>>, FileReport) {
    let mut report = FileReport { path: path.display().to_string(), ..FileReport::default() };
    let bytes = match raw {
        Raw::TooLarge => {
            report.error = Some(format!("larger than {MAX_WARM_FILE} bytes; not read"));
            return (None, report);
        }
        Raw::Missing => {
            report.error = Some("missing: only the config's [[warm]] images are warm until it appears".to_owned());
            return (Some(Vec::new()), report);
        }
        Raw::Unreadable(e) => {
            report.error = Some(format!("cannot read it: {e}"));
            return (None, report);
        }
        Raw::Bytes(bytes) => bytes,
    };
    let text = String::from_utf8_lossy(bytes);
    let complete = match text.rfind('\n') {
        Some(end) => &text[..=end],
        None => "",
    };
    if complete.len() < text.len() && !text[complete.len()..].trim().is_empty() {
        report.unterminated_line = Some(complete.lines().count() + 1);
    }
    let file = parse_warm_file(complete, upstreams, known);
    report.images = file.images.len();
    report.bad_lines = file.bad_lines.into_iter().map(|(line, message)| BadLine { line, message }).collect();
    (Some(file.images), report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn a_missing_file_is_empty_an_unreadable_one_keeps_the_old_list_and_bad_lines_are_numbered() {
        let config = Config::parse(
            "[[upstream]]\nname = \"docker.io\"\nurl = \"https://registry-1.docker.io\"\ndefault = true\n",
            "t.toml",
            None,
        )
        .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("warm.txt");
        let (images, report) = read_file(&path, &config.upstreams, &[]);
        assert_eq!(images, Some(Vec::new()), "missing: nothing from the file");
        assert!(report.error.unwrap().contains("missing"));
        assert_eq!(stamp(&path), None);

        std::fs::write(&path, "alpine:3.20\nnot an image!\n\ndocker.io/library/redis:7\n").unwrap();
        let first = stamp(&path);
        assert!(first.is_some());
        let (images, report) = read_file(&path, &config.upstreams, &[]);
        let repos: Vec<String> = images.unwrap().iter().map(|i| i.repo.to_string()).collect();
        assert_eq!(repos, ["library/alpine", "library/redis"]);
        assert_eq!(report.images, 2);
        assert_eq!(report.bad_lines.iter().map(|b| b.line).collect::<Vec<_>>(), [2]);
        assert_eq!(report.error, None);

        // Written in place, read half-way: the last line is not an image yet.
        std::fs::write(&path, "alpine:3.20\nredis:7\n# more\ndocker.io/library/postgres:1").unwrap();
        let (images, report) = read_file(&path, &config.upstreams, &[]);
        let repos: Vec<String> = images.unwrap().iter().map(|i| i.repo.to_string()).collect();
        assert_eq!(repos, ["library/alpine", "library/redis"], "not postgres:1 of postgres:16");
        assert_eq!((report.unterminated_line, report.bad_lines.len()), (Some(4), 0));
        std::fs::write(&path, "alpine:3.20").unwrap();
        let (images, report) = read_file(&path, &config.upstreams, &[]);
        assert_eq!((images.unwrap().len(), report.unterminated_line), (0, Some(1)));

        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        let (images, report) = read_file(&path, &config.upstreams, &[]);
        assert_eq!(images, None, "unreadable: the caller keeps its list");
        assert!(report.error.is_some());
    }
}
