//! `larder verify [--repair]`: re-hashes every cached blob of a stopped
//! larder's cache folder against its name and the index, with progress
//! ([`super::progress`]: a bar on a terminal, a line per phase otherwise),
//! then each problem on a line of its own, naming the blob or file and
//! what is wrong, and a summary that says what the counts are.

use crate::cache::{Cache, Report, VerifyWatch};
use crate::config::Config;
use crate::oci::Digest;
use crate::server::admin::status_page::bytes;

use super::progress::Progress;

/// Feeds `Cache::verify`'s counts and hashing to a [`Progress`].
struct Watched {
    progress: Progress,
}

impl VerifyWatch for Watched {
    fn counted(&mut self, blobs: u64, total: u64) {
        let what = format!("hashing {blobs} {} ({})", if blobs == 1 { "blob" } else { "blobs" }, bytes(total));
        self.progress.phase(what, total);
    }

    fn hashing(&mut self, digest: &Digest) {
        self.progress.item(digest.to_string());
    }

    fn hashed(&mut self, n: u64) {
        self.progress.advance(n);
    }
}

/// Verifies `config`'s cache folder; prints as it goes and returns the exit
/// status: 0 when nothing is bad (or `repair` removed it), 1 otherwise.
pub fn run(config: &Config, repair: bool, terminal: bool) -> u8 {
    let dir = config.cache.dir.display();
    let mut watched = Watched { progress: Progress::new("verify", terminal) };
    if !terminal {
        println!("verify: reading the index of {dir}");
    }
    let report = Cache::verify(&config.cache, repair, &mut watched);
    watched.progress.finish();
    let report = match report {
        Ok(r) => r,
        Err(e) => {
            eprintln!("larder verify: {dir}: {e}");
            return 1;
        }
    };
    for problem in &report.problems {
        println!("bad: {problem}");
    }
    println!("{dir}: {}", summary(&report, repair));
    match (report.bad(), repair) {
        (0, _) => 0,
        (_, true) => {
            println!("repaired: the bad entries were removed (pulls fetch those blobs again)");
            0
        }
        (_, false) => {
            println!("run `larder verify --repair` (with larder stopped) to remove them: pulls fetch them again");
            1
        }
    }
}

/// `12 blobs ok (140.0 MiB), 1 bad (1 indexed blob whose file is missing
/// or wrong: sha256:…: file is missing); 0 unindexed files found`.
pub fn summary(report: &Report, repair: bool) -> String {
    let plural = |n: u64, one: &str, many: &str| format!("{n} {}", if n == 1 { one } else { many });
    let mut kinds = Vec::new();
    if report.bad_rows > 0 {
        kinds.push(plural(
            report.bad_rows,
            "indexed blob whose file is missing or wrong",
            "indexed blobs whose files are missing or wrong",
        ));
    }
    if report.bad_files > 0 {
        kinds.push(plural(
            report.bad_files,
            "file that is not the blob its name says",
            "files that are not the blob their names say",
        ));
    }
    if report.unreadable > 0 {
        kinds.push(plural(
            report.unreadable,
            "blob whose file cannot be read (row kept)",
            "blobs whose files cannot be read (rows kept)",
        ));
    }
    let bad = match (report.bad(), report.problems.as_slice()) {
        (0, _) => "0 bad".to_owned(),
        (1, [only]) => format!("1 bad ({}: {only})", kinds.join(", ")),
        (n, _) => format!("{n} bad ({}; each listed above)", kinds.join(", ")),
    };
    format!(
        "{} ok ({}), {bad}; {} {}",
        plural(report.ok, "blob", "blobs"),
        bytes(report.blob_bytes),
        plural(report.adopted, "unindexed file", "unindexed files"),
        if repair { "indexed" } else { "found (correct blobs without an index row)" }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_says_what_each_count_is_and_names_a_single_problem() {
        let one = Report {
            ok: 11,
            bad_rows: 1,
            problems: vec!["sha256:ab: content hashes to sha256:cd".into()],
            blob_bytes: 2048,
            ..Report::default()
        };
        assert_eq!(
            summary(&one, false),
            "11 blobs ok (2.0 KiB), 1 bad (1 indexed blob whose file is missing or wrong: sha256:ab: content hashes \
             to sha256:cd); 0 unindexed files found (correct blobs without an index row)"
        );
        let two =
            Report { ok: 1, bad_rows: 1, bad_files: 1, problems: vec!["a".into(), "b".into()], ..Report::default() };
        assert_eq!(
            summary(&two, true),
            "1 blob ok (0 B), 2 bad (1 indexed blob whose file is missing or wrong, 1 file that is not the blob its \
             name says; each listed above); 0 unindexed files indexed"
        );
    }
}
