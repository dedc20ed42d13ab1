//! The admin token file, as larder trusts it from moment to moment.
//!
//! The file is watched (every [`RELOAD_INTERVAL`]) and fails closed:
//! - deleted, emptied, unreadable or holding something that is not a
//!   token: no token is accepted for mutating endpoints until it holds a
//!   valid one again. This is never a fall-back to the open, token-less
//!   mode: deleting the file is how an operator revokes the token.
//! - a new valid token is adopted only once two reads [`TOKEN_SETTLE`]
//!   apart agree, so a file caught mid-write (an in-place rewrite rather
//!   than Kubernetes' symlink swap) is never adopted as a prefix of the
//!   token. Until then the previous token stays valid: the file still
//!   names a token, the rotation is in progress, and a deliberate rotation
//!   should not lock the operator out for the settle time. (A read that is
//!   already invalid, such as the empty file an in-place rewrite starts
//!   with, revokes at once.)
//!
//! Each change of state (revoked, adopted, rotated) is logged once.
//!
//! It also writes the token a loopback admin listener uses when no
//! `[admin] token_file` is configured ([`generate`]).

use std::path::{Path, PathBuf};
use std::sync::RwLock;
use std::time::Duration;

use sha2::{Digest as _, Sha256};

use crate::config::{Secret, parse_admin_token};
use crate::server::reload::{RELOAD_INTERVAL, stamp};
use crate::shutdown::Shutdown;

/// Time between the two reads that must agree before a changed token is
/// adopted. A writer that pauses longer than this mid-write could have a
/// prefix adopted; in-place writes of a one-line file take microseconds.
pub const TOKEN_SETTLE: Duration = Duration::from_millis(500);

/// sha256 of a token: comparing digests keeps the compare constant-time
/// whatever the lengths.
pub type TokenDigest = [u8; 32];

pub fn digest(token: &str) -> TokenDigest {
    Sha256::digest(token.as_bytes()).into()
}

/// What larder accepts now.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Trust {
    /// This token.
    Token(TokenDigest),
    /// Nothing, because of this (what was wrong with the file).
    Revoked(String),
}

/// A token file and the token it is trusted to hold.
#[derive(Debug)]
pub struct TokenFile {
    path: PathBuf,
    trust: RwLock<Trust>,
}

/// What one look at the file found.
#[derive(Debug, PartialEq, Eq)]
pub enum Settled {
    /// The trust reflects the file (adopted, unchanged or revoked).
    Yes,
    /// The file changed between the two reads: look again next round.
    No,
}

impl TokenFile {
    /// Reads the file at start-up, where an invalid one is an error
    /// (blocking file I/O: call it on the blocking pool).
    pub fn load(path: &Path) -> Result<TokenFile, String> {
        let token = read(path)?;
        Ok(TokenFile { path: path.to_owned(), trust: RwLock::new(Trust::Token(digest(token.expose()))) })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The digest of the token accepted now, or why none is.
    pub fn expected(&self) -> Result<TokenDigest, String> {
        match &*self.trust.read().unwrap_or_else(|p| p.into_inner()) {
            Trust::Token(d) => Ok(*d),
            Trust::Revoked(why) => Err(why.clone()),
        }
    }

    /// Looks at the file once: a failed read revokes at once; a token other
    /// than the accepted one is read again after `settle` and adopted when
    /// both reads agree.
    pub async fn refresh(&self, settle: Duration) -> Settled {
        let first = match read_blocking(&self.path).await {
            Ok(token) => digest(token.expose()),
            Err(why) => {
                self.set(Trust::Revoked(why));
                return Settled::Yes;
            }
        };
        if self.expected() == Ok(first) {
            return Settled::Yes;
        }
        tokio::time::sleep(settle).await;
        match read_blocking(&self.path).await {
            Ok(token) if digest(token.expose()) == first => {
                self.set(Trust::Token(first));
                Settled::Yes
            }
            Ok(_) => {
                tracing::debug!(path = %self.path.display(), "admin token file still changing; looking again");
                Settled::No
            }
            Err(why) => {
                self.set(Trust::Revoked(why));
                Settled::Yes
            }
        }
    }

    /// Changes what is trusted, logging the change (only a change).
    fn set(&self, next: Trust) {
        let mut trust = self.trust.write().unwrap_or_else(|p| p.into_inner());
        if *trust == next {
            return;
        }
        let path = self.path.display();
        match (&*trust, &next) {
            (_, Trust::Revoked(why)) => tracing::warn!(
                %path,
                problem = %why,
                "admin token file unusable: no admin token is accepted (POST /prefetch, /purge refused) until it \
                 holds a valid token again"
            ),
            (Trust::Revoked(_), Trust::Token(_)) => {
                tracing::info!(%path, "admin token file valid again: token adopted")
            }
            (Trust::Token(_), Trust::Token(_)) => {
                tracing::info!(%path, "admin token rotated: the new token is adopted")
            }
        }
        *trust = next;
    }

    /// Watches the file until `shutdown` fires: looks again whenever its
    /// stamp (length, modification time, existence) changes, and every
    /// round while the last look did not settle.
    pub fn watch(self: std::sync::Arc<Self>, mut shutdown: Shutdown) {
        tokio::spawn(async move {
            let stamp_now = |path: PathBuf| async move {
                tokio::task::spawn_blocking(move || stamp(std::slice::from_ref(&path))).await.ok()
            };
            let mut last = stamp_now(self.path.clone()).await;
            let mut settled = Settled::Yes;
            loop {
                tokio::select! {
                    _ = shutdown.changed() => return,
                    () = tokio::time::sleep(RELOAD_INTERVAL) => {}
                }
                let now = stamp_now(self.path.clone()).await;
                if now == last && settled == Settled::Yes {
                    continue;
                }
                last = now;
                settled = self.refresh(TOKEN_SETTLE).await;
            }
        });
    }
}

/// Reads and parses the token file: one line of at least
/// [`crate::config::MIN_ADMIN_TOKEN_LEN`] visible ASCII characters.
fn read(path: &Path) -> Result<Secret, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if text.trim().is_empty() {
        return Err(format!("{} is empty", path.display()));
    }
    parse_admin_token(&text).map_err(|e| format!("{}: {e}", path.display()))
}

async fn read_blocking(path: &Path) -> Result<Secret, String> {
    let path = path.to_owned();
    tokio::task::spawn_blocking(move || read(&path))
        .await
        .unwrap_or_else(|e| Err(format!("reading the admin token file failed: {e}")))
}

/// Writes a new random token to `dir/`[`crate::config::GENERATED_ADMIN_TOKEN_FILE`]
/// (mode 0600: only larder's user, and root, can read it), replacing any
/// earlier one atomically, and returns the file's path. 32 random bytes,
/// hex-encoded. Blocking file I/O: call it on the blocking pool.
pub fn generate(dir: &Path) -> Result<PathBuf, String> {
    use std::io::Write as _;
    let path = dir.join(crate::config::GENERATED_ADMIN_TOKEN_FILE);
    let fail = |e: std::io::Error| format!("writing a generated admin token to {}: {e}", path.display());
    // tempfile creates its files with mode 0600, so the token is never
    // readable by others, not even for a moment.
    let mut file = tempfile::Builder::new().prefix(".admin-token.").tempfile_in(dir).map_err(fail)?;
    let token = hex::encode(rand::random::<[u8; 32]>());
    writeln!(file, "{token}").map_err(fail)?;
    file.as_file().sync_all().map_err(fail)?;
    file.persist(&path).map_err(|e| fail(e.error))?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_with(text: &str) -> (tempfile::TempDir, TokenFile) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("token"), text).unwrap();
        let file = TokenFile::load(&dir.path().join("token")).unwrap();
        (dir, file)
    }

    const SETTLE: Duration = Duration::from_millis(20);

    #[tokio::test]
    async fn a_deleted_emptied_or_invalid_file_revokes_the_token_and_a_valid_one_restores_it() {
        let (dir, file) = file_with("first-token-0123456789\n");
        let path = dir.path().join("token");
        assert_eq!(file.expected(), Ok(digest("first-token-0123456789")));

        std::fs::remove_file(&path).unwrap();
        assert_eq!(file.refresh(SETTLE).await, Settled::Yes);
        assert!(file.expected().unwrap_err().contains("cannot read"), "deleted: nothing accepted");

        std::fs::write(&path, "first-token-0123456789\n").unwrap();
        file.refresh(SETTLE).await;
        assert_eq!(file.expected(), Ok(digest("first-token-0123456789")), "restored");

        for (bad, problem) in
            [("", "is empty"), ("\n", "is empty"), ("short\n", "at least 16"), ("two words here!!\n", "visible")]
        {
            std::fs::write(&path, bad).unwrap();
            file.refresh(SETTLE).await;
            let why = file.expected().unwrap_err();
            assert!(why.contains(problem), "{bad:?}: {why}");
        }

        std::fs::write(&path, "second-token-0123456789\n").unwrap();
        file.refresh(SETTLE).await;
        assert_eq!(file.expected(), Ok(digest("second-token-0123456789")), "a new valid token is adopted");
    }

    // On a paused clock the order is fixed whatever the machine's load: the
    // first read (a blocking task; time does not advance while it runs) at
    // 0, the writer at SETTLE / 2, the second read at SETTLE. On a real
    // clock a loaded machine could start the first read after the writer.
    #[tokio::test(start_paused = true)]
    async fn a_token_is_adopted_only_when_two_reads_agree_and_the_old_one_holds_until_then() {
        let (dir, file) = file_with("old-token-0123456789\n");
        let path = dir.path().join("token");
        // Caught mid-write: the first read sees a valid-looking prefix, the second the whole token.
        std::fs::write(&path, "new-token-01234567").unwrap();
        let writer = {
            let path = path.clone();
            async move {
                tokio::time::sleep(SETTLE / 2).await;
                std::fs::write(&path, "new-token-0123456789abcdef\n").unwrap();
            }
        };
        let (settled, ()) = tokio::join!(file.refresh(SETTLE), writer);
        assert_eq!(settled, Settled::No, "the reads disagreed");
        assert_eq!(
            file.expected(),
            Ok(digest("old-token-0123456789")),
            "the prefix was not adopted; the old token holds"
        );
        assert_eq!(file.refresh(SETTLE).await, Settled::Yes);
        assert_eq!(file.expected(), Ok(digest("new-token-0123456789abcdef")), "adopted once it stood still");
    }

    #[test]
    fn a_generated_token_is_private_and_valid_and_replaced_at_each_start() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = generate(dir.path()).unwrap();
        assert_eq!(path, dir.path().join("admin-token"));
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        let first = read(&path).unwrap();
        assert_eq!(first.expose().len(), 64);
        generate(dir.path()).unwrap();
        assert_ne!(read(&path).unwrap().expose(), first.expose(), "a new token each start");
        let leftovers = std::fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(leftovers, 1, "no temporary file left behind");
    }
}
