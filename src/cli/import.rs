//! `larder import PATH [--as UPSTREAM/REPO]`: an OCI image layout (a
//! folder, or a tar of one) loaded into the cache. On a stopped cache
//! folder it opens the cache itself; while larder runs (the folder is
//! locked) it sends the layout to the admin listener (`POST /import`) as a
//! tar with `oci-layout` and `index.json` first, whatever order an
//! archive has them in, so that larder knows where the images go (and
//! whether policy admits them) before a byte of blobs arrives.
//!
//! Progress as `verify` shows it ([`super::progress`]): on a terminal a
//! bar (bytes of the total, rate, the blob being read or sent), otherwise
//! a line when each phase starts and ends and one every
//! [`super::progress::PLAIN_INTERVAL`] between. Then where each image went.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::Method;

use super::client::{AdminClient, CallError, RequestBody, read_body};
use super::progress::Progress;
use crate::cache::Cache;
use crate::cache::export::tar_file_header;
use crate::cache::import::reader::{self, Visitor};
use crate::cache::import::{ImportError, ImportLimits, ImportWatch, Imported, LayoutSource, Phase};
use crate::config::Config;
use crate::error::Error;
use crate::oci::Digest;
use crate::oci::layout::{LayoutIndex, OCI_LAYOUT};
use crate::server::admin::seed::targets;
use crate::server::admin::status_page::bytes;
use crate::upstream::Upstreams;

/// Longest an import's upload and check may take before the answer.
pub const IMPORT_TIMEOUT: Duration = Duration::from_secs(3600);
/// Request body chunks in flight to the connection.
const CHUNKS_IN_FLIGHT: usize = 16;
/// Bytes of a layout tar sent per request body chunk.
const UPLOAD_CHUNK: usize = 256 << 10;

/// `larder import`: on the stopped cache folder of `config`, or through
/// `client` when larder runs.
pub async fn import(
    config: &Config,
    client: impl FnOnce() -> Result<AdminClient, CallError>,
    path: &Path,
    as_name: Option<&str>,
    terminal: bool,
) -> Result<(), CallError> {
    let is_dir = std::fs::metadata(path).map_err(|e| CallError::Usage(format!("{}: {e}", path.display())))?.is_dir();
    let imported = match Cache::open(config.cache.clone()).await {
        Ok(cache) => {
            println!("importing {} into {} (larder is not running)", path.display(), config.cache.dir.display());
            let progress = SharedProgress::new(terminal);
            let upstreams = Arc::new(Upstreams::new(config).map_err(CallError::Usage)?);
            let as_name = as_name.map(str::to_owned);
            let resolver = Box::new(move |index: &LayoutIndex| targets(&upstreams, index, as_name.as_deref()));
            let source =
                if is_dir { LayoutSource::Dir(path.to_owned()) } else { LayoutSource::Archive(path.to_owned()) };
            let imported = cache.import_layout(source, resolver, Box::new(progress.clone())).await;
            progress.finish();
            imported.map_err(refused)?
        }
        Err(Error::CacheInUse(_)) => {
            let client = client()?;
            println!("importing {} through {}", path.display(), client.base());
            let progress = SharedProgress::new(terminal);
            let mut query = form_urlencoded::Serializer::new(String::new());
            if let Some(name) = as_name {
                query.append_pair("as", name);
            }
            let failed = Arc::new(Mutex::new(None));
            let body = layout_tar(path.to_owned(), is_dir, progress.clone(), Arc::clone(&failed));
            let sent = client
                .send(Method::POST, &format!("/import?{}", query.finish()), "application/json", body, IMPORT_TIMEOUT)
                .await;
            progress.finish();
            // A layout that could not be read here is the reason, not the cut upload.
            if let Some(e) = failed.lock().unwrap_or_else(|p| p.into_inner()).take() {
                return Err(CallError::Usage(format!("{}: {e}", path.display())));
            }
            let answer = read_body(sent?.into_body()).await?;
            serde_json::from_slice(&answer).map_err(|e| CallError::Protocol(format!("the answer is not JSON: {e}")))?
        }
        Err(e) => return Err(CallError::Usage(format!("{}: {e}", config.cache.dir.display()))),
    };
    report(&imported);
    Ok(())
}

fn refused(e: Error) -> CallError {
    CallError::Protocol(e.to_string())
}

fn plural(n: usize, one: &str) -> String {
    if n == 1 { format!("{n} {one}") } else { format!("{n} {one}s") }
}

fn report(imported: &Imported) {
    let mut line = format!(
        "imported {}: {}, {}, {}",
        plural(imported.images, "image"),
        plural(imported.manifests, "manifest"),
        plural(imported.blobs, "blob"),
        bytes(imported.bytes)
    );
    if imported.confirmed > 0 {
        line.push_str(&format!(" ({} the layout lacks, which upstream confirmed)", plural(imported.confirmed, "blob")));
    }
    println!("{line}");
    for destination in &imported.destinations {
        println!("  {destination}");
    }
    if imported.missing_platforms > 0 {
        println!(
            "{} of a multi-platform image are not in the layout: pulls of them go upstream",
            plural(imported.missing_platforms, "platform")
        );
    }
}

/// The layout at `path` as a tar request body: `oci-layout` and
/// `index.json` first, then each blob file (read with the same reader
/// larder uses, so links and stray files are left out alike). A layout
/// that cannot be read ends the body with an error, and the reason is
/// left in `failed`.
fn layout_tar(
    path: PathBuf,
    is_dir: bool,
    progress: SharedProgress,
    failed: Arc<Mutex<Option<ImportError>>>,
) -> RequestBody {
    let (writer, body) = crate::body::written_body(CHUNKS_IN_FLIGHT);
    tokio::task::spawn_blocking(move || {
        let total = if is_dir { blob_bytes(&path) } else { std::fs::metadata(&path).map_or(0, |m| m.len()) };
        let mut progress = progress;
        progress.phase(Phase::Reading, "sending the layout", total);
        let out = std::io::BufWriter::with_capacity(UPLOAD_CHUNK, writer.clone());
        let mut sender = Sender { tar: tar::Builder::new(out), progress: progress.clone() };
        // larder bounds what it accepts; here the layout is read as it is.
        let limits = ImportLimits::with_max_bytes(u64::MAX);
        let read = match is_dir {
            true => reader::read_dir(&path, &limits, &mut sender),
            false => reader::read_archive(&path, &limits, &mut sender),
        };
        let written = read.and_then(|()| {
            let mut out = sender.tar.into_inner()?;
            out.flush()?;
            Ok(())
        });
        match written {
            Ok(()) => progress.phase(Phase::Committing, "larder checks and commits it", 0),
            // larder stopped reading (it answered already, a refusal): its answer says why.
            Err(ImportError::Io(e)) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
            Err(e) => {
                writer.fail(Box::new(std::io::Error::other(e.to_string())));
                *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
            }
        }
    });
    body
}

/// Bytes of a layout folder's blob files (the upload's total).
fn blob_bytes(dir: &Path) -> u64 {
    let Ok(listing) = std::fs::read_dir(dir.join("blobs/sha256")) else { return 0 };
    listing.filter_map(|e| e.ok()?.metadata().ok()).filter(|m| m.is_file()).map(|m| m.len()).sum()
}

/// Writes what the layout reader hands on into the upload's tar.
struct Sender<W: Write> {
    tar: tar::Builder<W>,
    progress: SharedProgress,
}

impl<W: Write> Visitor for Sender<W> {
    fn index(&mut self, _index: LayoutIndex, bytes: &[u8]) -> Result<(), ImportError> {
        let layout = OCI_LAYOUT.as_bytes();
        self.tar.append_data(&mut tar_file_header(layout.len() as u64), "oci-layout", layout)?;
        self.tar.append_data(&mut tar_file_header(bytes.len() as u64), "index.json", bytes)?;
        Ok(())
    }

    fn blob(&mut self, named: Digest, path: &str, size: u64, data: &mut dyn Read) -> Result<(), ImportError> {
        self.progress.item(path);
        let counted = Counted { inner: data, progress: &mut self.progress };
        let name = format!("blobs/sha256/{}", named.hex().as_str());
        self.tar.append_data(&mut tar_file_header(size), name, counted)?;
        Ok(())
    }
}

/// A reader that tells the progress display how much it read.
struct Counted<'a> {
    inner: &'a mut dyn Read,
    progress: &'a mut SharedProgress,
}

impl Read for Counted<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.progress.advance(n as u64);
        Ok(n)
    }
}

/// An import's progress (the shared [`Progress`] of `verify` and
/// `export`), held by the task reading the layout and the command alike.
#[derive(Clone)]
pub struct SharedProgress(Arc<Mutex<Progress>>);

impl SharedProgress {
    fn new(terminal: bool) -> SharedProgress {
        SharedProgress(Arc::new(Mutex::new(Progress::new("import", terminal))))
    }

    fn with(&self, f: impl FnOnce(&mut Progress)) {
        f(&mut self.0.lock().unwrap_or_else(|p| p.into_inner()));
    }

    /// Ends the last phase and clears the bar, before the command's result.
    pub fn finish(&self) {
        self.with(Progress::finish);
    }
}

impl ImportWatch for SharedProgress {
    fn phase(&mut self, _phase: Phase, what: &str, total: u64) {
        self.with(|p| p.phase(what, total));
    }

    fn item(&mut self, item: &str) {
        self.with(|p| p.item(item));
    }

    fn advance(&mut self, n: u64) {
        self.with(|p| p.advance(n));
    }
}
