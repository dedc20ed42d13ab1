//! Reading an OCI image layout, from a tar stream, a tar file or a folder,
//! within [`ImportLimits`]: what it hands on is `index.json` (parsed, as
//! soon as it is read) and each `blobs/sha256/<hex>` file with its bytes,
//! to a [`Visitor`] (the staging area, `larder import`'s upload, or a fuzz
//! target's memory).
//!
//! What a hostile tar cannot do here: make the reader hold more than
//! [`ImportLimits::max_header_bytes`] of tar headers for one entry (the
//! `tar` crate reads GNU long names and PAX records whole into memory, so
//! the bytes it reads while looking for an entry are counted and cut off);
//! pass more than `max_bytes` or `max_entries`; slip in a second
//! `index.json`; expand a sparse entry into more bytes than it carries;
//! or end early without it being noticed (a stream that stops where the
//! next header should be, with no end-of-archive block, is cut off).
//! Entries that are not regular files, and files that are no part of a
//! layout, are read past and ignored; `..`, absolute paths and links never
//! name a layout file.

use std::cell::{Cell, RefCell};
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::{Component, Path};
use std::rc::Rc;

use super::ImportError;
use super::limits::ImportLimits;
use crate::oci::Digest;
use crate::oci::layout::{LayoutIndex, MAX_INDEX_JSON};

/// Largest `oci-layout` file read (it holds `{"imageLayoutVersion":"1.0.0"}`).
const MAX_LAYOUT_FILE: u64 = 4 << 10;

/// What a layout's files are handed to, in the order the layout holds them.
pub trait Visitor {
    /// `index.json` (parsed, and its bytes), as soon as it is read: every
    /// blob handed on after this call comes after it in the layout.
    fn index(&mut self, index: LayoutIndex, bytes: &[u8]) -> Result<(), ImportError>;
    /// The file `path` (`blobs/sha256/<hex>`), named `named`, of `size`
    /// bytes: read `data` to its end.
    fn blob(&mut self, named: Digest, path: &str, size: u64, data: &mut dyn Read) -> Result<(), ImportError>;
}

/// A layout file, by its path in the layout.
#[derive(Debug, PartialEq, Eq)]
enum Name {
    LayoutFile,
    Index,
    Blob(Digest),
    /// Anything else: read past.
    Other,
}

/// Names a path: only plain components count, so `../index.json` or
/// `/index.json` is nothing of the layout. A file under `blobs/sha256/`
/// whose name is not a sha256 hex digest is refused.
fn name_of(path: &Path) -> Result<Name, ImportError> {
    let mut parts = Vec::new();
    for c in path.components() {
        match c {
            Component::CurDir => {}
            Component::Normal(part) => match part.to_str() {
                Some(part) => parts.push(part),
                None => return Ok(Name::Other),
            },
            Component::ParentDir | Component::RootDir | Component::Prefix(_) => return Ok(Name::Other),
        }
    }
    Ok(match parts.as_slice() {
        ["oci-layout"] => Name::LayoutFile,
        ["index.json"] => Name::Index,
        ["blobs", "sha256", hex] => match format!("sha256:{hex}").parse::<Digest>() {
            Ok(digest) => Name::Blob(digest),
            Err(_) => {
                let shown: String = path.display().to_string().chars().take(200).collect();
                return Err(ImportError::NotALayout(format!("{shown}: not named by a sha256 digest")));
            }
        },
        _ => Name::Other,
    })
}

/// `index.json`: parsed, and its bytes.
pub struct IndexJson {
    pub index: LayoutIndex,
    pub bytes: Vec<u8>,
}

/// Reads `index.json`'s bytes (at most [`MAX_INDEX_JSON`]) and parses them.
fn read_index(data: &mut dyn Read) -> Result<IndexJson, ImportError> {
    let mut bytes = Vec::new();
    data.take(MAX_INDEX_JSON + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_INDEX_JSON {
        return Err(ImportError::NotALayout(format!("index.json is over {MAX_INDEX_JSON} bytes")));
    }
    let index = LayoutIndex::parse(&bytes).map_err(|e| ImportError::NotALayout(e.to_string()))?;
    Ok(IndexJson { index, bytes })
}

/// Reads an `oci-layout` file (bounded) and checks it is the layout
/// version larder reads.
fn check_layout_file(data: &mut dyn Read) -> Result<(), ImportError> {
    let mut bytes = Vec::new();
    data.take(MAX_LAYOUT_FILE + 1).read_to_end(&mut bytes)?;
    #[derive(serde::Deserialize)]
    struct LayoutFile {
        #[serde(rename = "imageLayoutVersion")]
        version: String,
    }
    match serde_json::from_slice::<LayoutFile>(&bytes) {
        Ok(f) if f.version.starts_with("1.") => Ok(()),
        Ok(f) => {
            let version: String = f.version.chars().take(32).collect();
            Err(ImportError::NotALayout(format!("oci-layout says version {version:?}; larder reads 1.x")))
        }
        Err(_) => Err(ImportError::NotALayout("oci-layout is not {\"imageLayoutVersion\": …}".into())),
    }
}

/// Counts what is read from a layout, and refuses past its bounds: all
/// bytes against `max_bytes`; while the tar reader looks for the next
/// entry (`in_headers`), those bytes against `max_header_bytes`, noting an
/// end of stream there (a tar cut off between entries).
struct Meter {
    limits: ImportLimits,
    total: Cell<u64>,
    in_headers: Cell<bool>,
    header_bytes: Cell<u64>,
    eof_in_headers: Cell<bool>,
    /// Why the last read failed, when it was a bound: the `tar` crate
    /// wraps I/O errors, so the refusal waits here to be picked up.
    refusal: RefCell<Option<ImportError>>,
}

impl Meter {
    fn new(limits: &ImportLimits) -> Rc<Meter> {
        Rc::new(Meter {
            limits: *limits,
            total: Cell::new(0),
            in_headers: Cell::new(false),
            header_bytes: Cell::new(0),
            eof_in_headers: Cell::new(false),
            refusal: RefCell::new(None),
        })
    }

    fn count(&self, n: usize, asked: usize) -> io::Result<()> {
        let total = self.total.get() + n as u64;
        self.total.set(total);
        if total > self.limits.max_bytes {
            return Err(self.refuse(ImportError::TooLarge(format!(
                "the layout is over {} bytes (cache.max_import_size)",
                self.limits.max_bytes
            ))));
        }
        if self.in_headers.get() {
            if n == 0 && asked > 0 {
                self.eof_in_headers.set(true);
            }
            let header_bytes = self.header_bytes.get() + n as u64;
            self.header_bytes.set(header_bytes);
            if header_bytes > self.limits.max_header_bytes {
                return Err(self.refuse(ImportError::TooLarge(format!(
                    "a tar entry's headers (long names, PAX records) are over {} bytes",
                    self.limits.max_header_bytes
                ))));
            }
        }
        Ok(())
    }

    fn refuse(&self, why: ImportError) -> io::Error {
        let message = why.to_string();
        *self.refusal.borrow_mut() = Some(why);
        io::Error::other(message)
    }

    /// The bound that failed a read, or `e` as what it says.
    fn refusal_or(&self, e: io::Error, what: &str) -> ImportError {
        self.refusal.borrow_mut().take().unwrap_or_else(|| ImportError::NotALayout(format!("{what}: {e}")))
    }

    fn headers(&self, on: bool) {
        self.in_headers.set(on);
        self.header_bytes.set(0);
    }
}

/// A reader counted by a [`Meter`].
struct Metered<R> {
    inner: R,
    meter: Rc<Meter>,
}

impl<R: Read> Read for Metered<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.meter.count(n, buf.len())?;
        Ok(n)
    }
}

impl<R: Seek> Seek for Metered<R> {
    fn seek(&mut self, pos: SeekFrom) -> io::Result<u64> {
        self.inner.seek(pos)
    }
}

/// An entry's data, which must deliver the size its header gives: a tar
/// that ends inside an entry was cut off (the `tar` crate reads a short
/// entry as a short file).
struct Whole<'a, R> {
    inner: R,
    left: u64,
    meter: &'a Meter,
    path: &'a Path,
}

impl<R: Read> Read for Whole<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if n == 0 && self.left > 0 && !buf.is_empty() {
            let shown: String = self.path.display().to_string().chars().take(200).collect();
            let why = format!("the tar ends inside {shown}, {} bytes short: it was cut off", self.left);
            return Err(self.meter.refuse(ImportError::NotALayout(why)));
        }
        self.left = self.left.saturating_sub(n as u64);
        Ok(n)
    }
}

/// What a tar's first pass found: whether it has an `oci-layout` file,
/// and its `index.json`.
pub struct Head {
    pub layout_file: bool,
    pub index: Option<IndexJson>,
}

/// Walks a tar's entries, handing layout files to `visitor`. With `head`
/// (from a first pass, [`archive_head`]), `index.json` is handed on first
/// and skipped where the tar holds it.
fn walk_tar<R: Read>(
    entries: tar::Entries<'_, Metered<R>>,
    meter: &Meter,
    head: Option<Head>,
    visitor: &mut dyn Visitor,
) -> Result<(), ImportError> {
    let (mut layout_file, mut index_handed) = (false, false);
    if let Some(head) = head {
        layout_file = head.layout_file;
        if let Some(json) = head.index {
            index_handed = true;
            visitor.index(json.index, &json.bytes)?;
        }
    }
    let mut indexes_in_tar = 0usize;
    let mut entries = entries;
    let mut count = 0usize;
    loop {
        let Some(entry) = next_entry(&mut entries, meter, &mut count)? else { break };
        let (kind, path) = (entry.header().entry_type(), entry_path(&entry, meter)?);
        let size = entry.size();
        let mut entry = Whole { inner: entry, left: size, meter, path: &path };
        match (kind.is_file(), name_of(&path)?) {
            (true, Name::LayoutFile) => {
                check_layout_file(&mut entry).map_err(|e| refusal_in(meter, e))?;
                layout_file = true;
            }
            (true, Name::Index) => {
                indexes_in_tar += 1;
                if indexes_in_tar > 1 {
                    return Err(ImportError::NotALayout("the tar holds index.json twice".into()));
                }
                if !index_handed {
                    let json = read_index(&mut entry).map_err(|e| refusal_in(meter, e))?;
                    index_handed = true;
                    visitor.index(json.index, &json.bytes)?;
                }
            }
            (true, Name::Blob(digest)) => {
                let shown = path.display().to_string();
                visitor.blob(digest, &shown, size, &mut entry).map_err(|e| refusal_in(meter, e))?;
            }
            _ => {}
        }
        // Whatever the entry still holds is read past (and counted).
        io::copy(&mut entry, &mut io::sink()).map_err(|e| meter.refusal_or(e, "reading the layout's tar"))?;
    }
    end_of_tar(meter)?;
    if !layout_file {
        return Err(ImportError::NotALayout("no oci-layout file".into()));
    }
    if !index_handed {
        return Err(ImportError::NotALayout("no index.json".into()));
    }
    Ok(())
}

/// The next entry, its headers read within their bound; `None` at the end.
/// Entries are counted against `max_entries`; a sparse one is refused.
fn next_entry<'a, R: Read>(
    entries: &mut tar::Entries<'a, Metered<R>>,
    meter: &Meter,
    count: &mut usize,
) -> Result<Option<tar::Entry<'a, Metered<R>>>, ImportError> {
    meter.headers(true);
    let next = entries.next();
    meter.headers(false);
    let entry = match next {
        None => return Ok(None),
        Some(Ok(entry)) => entry,
        Some(Err(e)) => return Err(meter.refusal_or(e, "reading the layout's tar")),
    };
    *count += 1;
    if *count > meter.limits.max_entries {
        return Err(ImportError::TooLarge(format!("the tar holds over {} entries", meter.limits.max_entries)));
    }
    if entry.header().entry_type().is_gnu_sparse() {
        let shown: String = entry_path(&entry, meter)?.display().to_string().chars().take(200).collect();
        return Err(ImportError::NotALayout(format!("{shown}: a sparse file, which no layout holds")));
    }
    Ok(Some(entry))
}

fn entry_path<R: Read>(entry: &tar::Entry<'_, R>, meter: &Meter) -> Result<std::path::PathBuf, ImportError> {
    Ok(entry.path().map_err(|e| meter.refusal_or(e, "a tar entry's name"))?.into_owned())
}

/// A tar must end with its end-of-archive block: a stream that stopped
/// where the next header should be was cut off.
fn end_of_tar(meter: &Meter) -> Result<(), ImportError> {
    if meter.eof_in_headers.get() {
        return Err(ImportError::NotALayout("the tar ends without its end-of-archive block: it was cut off".into()));
    }
    Ok(())
}

/// An error from a visitor or a read inside an entry: a bound the meter
/// refused wins over the I/O error it caused; any other I/O error (the
/// staging area's disk full, a failed read or write) stays one, never a
/// fault of the layout.
fn refusal_in(meter: &Meter, e: ImportError) -> ImportError {
    match e {
        ImportError::Io(io) => meter.refusal.borrow_mut().take().unwrap_or(ImportError::Io(io)),
        e => e,
    }
}

/// Reads a layout from a tar stream (a request body): `index.json` is
/// handed on where the stream holds it.
pub fn read_tar(reader: impl Read, limits: &ImportLimits, visitor: &mut dyn Visitor) -> Result<(), ImportError> {
    let meter = Meter::new(limits);
    let mut archive = tar::Archive::new(Metered { inner: reader, meter: Rc::clone(&meter) });
    let entries = archive.entries().map_err(|e| meter.refusal_or(e, "reading the layout's tar"))?;
    walk_tar(entries, &meter, None, visitor)
}

/// The first pass over a tar file: its `oci-layout` file and `index.json`,
/// skipping over blob data (seeking, not reading), so that a second pass
/// can hand on `index.json` before any blob whatever order the tar has
/// (skopeo's `oci-archive:` puts it last).
pub fn archive_head(file: &mut File, limits: &ImportLimits) -> Result<Head, ImportError> {
    let meter = Meter::new(limits);
    let mut head = Head { layout_file: false, index: None };
    {
        let mut archive = tar::Archive::new(Metered { inner: &mut *file, meter: Rc::clone(&meter) });
        let mut entries = archive.entries_with_seek().map_err(|e| meter.refusal_or(e, "reading the layout's tar"))?;
        let mut count = 0usize;
        while let Some(entry) = next_entry(&mut entries, &meter, &mut count)? {
            if !entry.header().entry_type().is_file() {
                continue;
            }
            let path = entry_path(&entry, &meter)?;
            let size = entry.size();
            let mut entry = Whole { inner: entry, left: size, meter: &meter, path: &path };
            match name_of(&path)? {
                Name::LayoutFile => {
                    check_layout_file(&mut entry).map_err(|e| refusal_in(&meter, e))?;
                    head.layout_file = true;
                }
                Name::Index if head.index.is_some() => {
                    return Err(ImportError::NotALayout("the tar holds index.json twice".into()));
                }
                Name::Index => head.index = Some(read_index(&mut entry).map_err(|e| refusal_in(&meter, e))?),
                Name::Blob(_) | Name::Other => {}
            }
        }
        end_of_tar(&meter)?;
    }
    file.seek(SeekFrom::Start(0))?;
    Ok(head)
}

/// Reads a layout from a tar file: [`archive_head`], then every blob,
/// `index.json` handed on first.
pub fn read_archive(path: &Path, limits: &ImportLimits, visitor: &mut dyn Visitor) -> Result<(), ImportError> {
    let mut file = File::open(path)?;
    let head = archive_head(&mut file, limits)?;
    let meter = Meter::new(limits);
    let mut archive = tar::Archive::new(Metered { inner: file, meter: Rc::clone(&meter) });
    let entries = archive.entries().map_err(|e| meter.refusal_or(e, "reading the layout's tar"))?;
    walk_tar(entries, &meter, Some(head), visitor)
}

/// Reads a layout folder: `oci-layout`, `index.json`, then the regular
/// files of `blobs/sha256/` (links and folders there are passed over; a
/// `blobs` or `blobs/sha256` that is a link refuses the layout).
pub fn read_dir(dir: &Path, limits: &ImportLimits, visitor: &mut dyn Visitor) -> Result<(), ImportError> {
    let meter = Meter::new(limits);
    let open = |name: &str| -> Result<Metered<File>, ImportError> {
        let path = dir.join(name);
        match std::fs::symlink_metadata(&path) {
            Ok(m) if m.is_file() => Ok(Metered { inner: File::open(&path)?, meter: Rc::clone(&meter) }),
            Ok(_) => Err(ImportError::NotALayout(format!("{name} is not a regular file"))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Err(ImportError::NotALayout(format!("no {name}"))),
            Err(e) => Err(e.into()),
        }
    };
    check_layout_file(&mut open("oci-layout")?).map_err(|e| refusal_in(&meter, e))?;
    let json = read_index(&mut open("index.json")?).map_err(|e| refusal_in(&meter, e))?;
    visitor.index(json.index, &json.bytes)?;
    // The folders are the layout's own, never links: `blobs/sha256` linked
    // to a folder of larder's store would "carry" every cached blob there,
    // and a manifest naming another tenant's blob would get it with no
    // byte of it in the layout.
    for folder in ["blobs", "blobs/sha256"] {
        match std::fs::symlink_metadata(dir.join(folder)) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => return Err(ImportError::NotALayout(format!("{folder} is a link or a file, not a folder"))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e.into()),
        }
    }
    let folder = dir.join("blobs/sha256");
    let listing = match std::fs::read_dir(&folder) {
        Ok(listing) => listing,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e.into()),
    };
    let mut count = 0usize;
    for entry in listing {
        let entry = entry?;
        count += 1;
        if count > limits.max_entries {
            return Err(ImportError::TooLarge(format!("blobs/sha256 holds over {} entries", limits.max_entries)));
        }
        if !entry.file_type()?.is_file() {
            continue;
        }
        let relative = Path::new("blobs/sha256").join(entry.file_name());
        let Name::Blob(digest) = name_of(&relative)? else { continue };
        let file = File::open(entry.path())?;
        let size = file.metadata()?.len();
        let mut data = Metered { inner: file, meter: Rc::clone(&meter) };
        let shown = relative.display().to_string();
        visitor.blob(digest, &shown, size, &mut data).map_err(|e| refusal_in(&meter, e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a reader handed on.
    #[derive(Default)]
    struct Seen {
        indexes: usize,
        blobs: Vec<Digest>,
    }

    impl Visitor for Seen {
        fn index(&mut self, _: LayoutIndex, _: &[u8]) -> Result<(), ImportError> {
            self.indexes += 1;
            Ok(())
        }

        fn blob(&mut self, named: Digest, _: &str, _: u64, data: &mut dyn Read) -> Result<(), ImportError> {
            io::copy(data, &mut io::sink())?;
            self.blobs.push(named);
            Ok(())
        }
    }

    const INDEX: &str = r#"{"schemaVersion":2,"manifests":[]}"#;
    const LAYOUT: &str = r#"{"imageLayoutVersion":"1.0.0"}"#;

    fn header(size: usize, kind: tar::EntryType) -> tar::Header {
        let mut header = tar::Header::new_gnu();
        header.set_size(size as u64);
        header.set_mode(0o644);
        header.set_entry_type(kind);
        header
    }

    /// A tar of `files`, each a regular file, without its end-of-archive blocks.
    fn entries(files: &[(&str, &[u8])]) -> tar::Builder<Vec<u8>> {
        let mut tar = tar::Builder::new(Vec::new());
        for (path, bytes) in files {
            tar.append_data(&mut header(bytes.len(), tar::EntryType::Regular), path, *bytes).unwrap();
        }
        tar
    }

    fn read(bytes: &[u8], limits: &ImportLimits) -> (Result<(), ImportError>, Seen) {
        let mut seen = Seen::default();
        (read_tar(bytes, limits, &mut seen), seen)
    }

    fn limits() -> ImportLimits {
        ImportLimits::with_max_bytes(1 << 30)
    }

    #[test]
    fn a_layout_reads_whole_and_hands_index_json_on_once() {
        let blob = b"a blob";
        let name = format!("blobs/sha256/{}", Digest::of(blob).hex().as_str());
        let tar = entries(&[("oci-layout", LAYOUT.as_bytes()), ("index.json", INDEX.as_bytes()), (&name, blob)]);
        let (result, seen) = read(&tar.into_inner().unwrap(), &limits());
        assert!(result.is_ok(), "{result:?}");
        assert_eq!((seen.indexes, seen.blobs), (1, vec![Digest::of(blob)]));
    }

    #[test]
    fn a_tar_cut_off_inside_an_entry_is_refused_as_cut_off() {
        let blob = vec![1u8; 4096];
        let name = format!("blobs/sha256/{}", Digest::of(&blob).hex().as_str());
        let tar = entries(&[("oci-layout", LAYOUT.as_bytes()), ("index.json", INDEX.as_bytes()), (&name, &blob)]);
        let mut bytes = tar.into_inner().unwrap();
        bytes.truncate(bytes.len() - 1024 - 2048);
        match read(&bytes, &limits()).0 {
            Err(ImportError::NotALayout(m)) => assert!(m.contains("2048 bytes short: it was cut off"), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_tar_cut_off_between_entries_is_refused() {
        let tar = entries(&[("oci-layout", LAYOUT.as_bytes()), ("index.json", INDEX.as_bytes())]);
        let mut bytes = tar.into_inner().unwrap();
        bytes.truncate(bytes.len() - 1024); // the end-of-archive blocks
        match read(&bytes, &limits()).0 {
            Err(ImportError::NotALayout(m)) => assert!(m.contains("cut off"), "{m}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_long_name_past_the_header_bound_is_refused_before_it_is_held() {
        let long = "x/".repeat(200 << 10);
        let tar = entries(&[("oci-layout", LAYOUT.as_bytes()), (&long, b"data")]);
        let bytes = tar.into_inner().unwrap();
        assert!(bytes.len() > 400 << 10);
        match read(&bytes, &limits()).0 {
            Err(ImportError::TooLarge(m)) => assert!(m.contains("headers"), "{m}"),
            other => panic!("{other:?}"),
        }
        let fits = entries(&[
            ("oci-layout", LAYOUT.as_bytes()),
            ("x/".repeat(100).as_str(), b"data"),
            ("index.json", INDEX.as_bytes()),
        ]);
        assert!(read(&fits.into_inner().unwrap(), &limits()).0.is_ok(), "a long name within the bound is fine");
    }

    #[test]
    fn index_json_twice_a_sparse_file_and_too_many_bytes_or_entries_are_refused() {
        let twice = entries(&[("index.json", INDEX.as_bytes()), ("./index.json", INDEX.as_bytes())]);
        assert!(
            matches!(read(&twice.into_inner().unwrap(), &limits()).0, Err(ImportError::NotALayout(m)) if m.contains("twice"))
        );

        let mut sparse = entries(&[("oci-layout", LAYOUT.as_bytes())]);
        sparse.append_data(&mut header(0, tar::EntryType::GNUSparse), "blobs/sha256/sparse", &b""[..]).unwrap();
        assert!(read(&sparse.into_inner().unwrap(), &limits()).0.is_err(), "a sparse entry");

        let blob = vec![7u8; 64 << 10];
        let name = format!("blobs/sha256/{}", Digest::of(&blob).hex().as_str());
        let big = entries(&[("oci-layout", LAYOUT.as_bytes()), ("index.json", INDEX.as_bytes()), (&name, &blob)]);
        let small = ImportLimits { max_bytes: 32 << 10, ..limits() };
        assert!(
            matches!(read(&big.into_inner().unwrap(), &small).0, Err(ImportError::TooLarge(m)) if m.contains("max_import_size"))
        );

        let files: Vec<(String, Vec<u8>)> = (0..20).map(|i| (format!("junk/{i}"), vec![])).collect();
        let refs: Vec<(&str, &[u8])> = files.iter().map(|(p, b)| (p.as_str(), b.as_slice())).collect();
        let few = ImportLimits { max_entries: 10, ..limits() };
        assert!(
            matches!(read(&entries(&refs).into_inner().unwrap(), &few).0, Err(ImportError::TooLarge(m)) if m.contains("entries"))
        );
    }

    /// Appends an entry named `name` as it is (the `tar` crate's builder
    /// refuses `..` and absolute paths; a hostile tar need not).
    fn raw(tar: &mut tar::Builder<Vec<u8>>, name: &str, kind: tar::EntryType, data: &[u8]) {
        let mut h = header(data.len(), kind);
        h.as_old_mut().name[..name.len()].copy_from_slice(name.as_bytes());
        h.set_cksum();
        tar.append(&h, data).unwrap();
    }

    #[test]
    fn only_regular_files_at_plain_paths_are_layout_files() {
        let blob = b"a blob";
        let hex = Digest::of(blob).hex();
        let mut tar = entries(&[("oci-layout", LAYOUT.as_bytes())]);
        raw(&mut tar, "../index.json", tar::EntryType::Regular, INDEX.as_bytes());
        raw(&mut tar, &format!("/blobs/sha256/{}", hex.as_str()), tar::EntryType::Regular, blob);
        raw(&mut tar, "index.json", tar::EntryType::Symlink, b"");
        raw(&mut tar, &format!("blobs/sha256/{}", hex.as_str()), tar::EntryType::Link, b"");
        let (result, seen) = read(&tar.into_inner().unwrap(), &limits());
        assert!(matches!(result, Err(ImportError::NotALayout(m)) if m == "no index.json"));
        assert!(seen.blobs.is_empty(), "an absolute path or a link is no blob of the layout");

        let bad = entries(&[("blobs/sha256/not-hex", b"x")]);
        let result = read(&bad.into_inner().unwrap(), &limits()).0;
        assert!(matches!(result, Err(ImportError::NotALayout(m)) if m.contains("not named by a sha256 digest")));
    }
}
