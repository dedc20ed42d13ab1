//! Is a range of a blob file in the page cache? `cachestat(2)` (Linux 6.5)
//! counts the cached pages of a range in one call, without reading or
//! mapping anything.
//!
//! A blob body sends a range with `sendfile(2)` on the connection's async
//! thread only when every page of it is cached, so that thread never waits
//! for the disk (sendfile has no `RWF_NOWAIT`); any other range is read on
//! the blocking pool as before ([`super::pread`]). This is larder's one
//! `unsafe` block: neither rustix nor libc wraps `cachestat` yet, so it is
//! called by its number.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};

/// `cachestat`'s number in the generic syscall table, which x86_64 and
/// aarch64 share for it (Linux 6.5, `include/uapi/asm-generic/unistd.h`).
const SYS_CACHESTAT: libc::c_long = 451;
/// Bytes per page as `cachestat` counts them: the kernel's page size.
const PAGE: u64 = 4096;

/// `struct cachestat_range` of `<linux/mman.h>`.
#[repr(C)]
struct Range {
    off: u64,
    len: u64,
}

/// `struct cachestat` of `<linux/mman.h>`.
#[repr(C)]
#[derive(Default)]
struct Stat {
    nr_cache: u64,
    nr_dirty: u64,
    nr_writeback: u64,
    nr_evicted: u64,
    nr_recently_evicted: u64,
}

/// Set once a call found no `cachestat` (an older kernel, a seccomp filter):
/// from then on every range counts as uncached, without asking again.
static UNSUPPORTED: AtomicBool = AtomicBool::new(false);

/// Whether every page of `len` bytes of `file` from `offset` is in the page
/// cache. `false` when some page is not, when the kernel cannot tell, or
/// for an empty range. The answer may be stale by the time it is used (a
/// page can be evicted just after), like any page-cache check.
pub fn cached(file: &File, offset: u64, len: u64) -> bool {
    if len == 0 || UNSUPPORTED.load(Ordering::Relaxed) {
        return false;
    }
    let range = Range { off: offset, len };
    let mut stat = Stat::default();
    // SAFETY: `cachestat(fd, range, cstat, flags)` reads one `Range` and
    // writes one `Stat`, both live `repr(C)` values matching the kernel's
    // structs; `fd` is borrowed from `file` for the duration of the call.
    #[allow(unsafe_code)]
    let ret =
        unsafe { libc::syscall(SYS_CACHESTAT, file.as_raw_fd(), &range as *const Range, &mut stat as *mut Stat, 0u32) };
    if ret != 0 {
        let errno = std::io::Error::last_os_error().raw_os_error();
        if matches!(errno, Some(libc::ENOSYS) | Some(libc::EPERM)) {
            UNSUPPORTED.store(true, Ordering::Relaxed);
        }
        return false;
    }
    let pages = (offset + len).div_ceil(PAGE) - offset / PAGE;
    stat.nr_cache >= pages
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_file_just_written_is_cached_and_a_range_past_its_end_is_not() {
        let mut temp = tempfile::NamedTempFile::new().unwrap();
        temp.write_all(&vec![7u8; 3 * PAGE as usize + 100]).unwrap();
        let file = temp.reopen().unwrap();
        assert!(cached(&file, 0, 3 * PAGE + 100), "written, so in the page cache");
        assert!(cached(&file, PAGE - 1, 2), "a range across a page boundary");
        assert!(!cached(&file, 0, 8 * PAGE), "pages past the end are not cached");
        assert!(!cached(&file, 0, 0), "an empty range is never worth a sendfile");
    }

    #[test]
    fn dropped_pages_are_not_cached() {
        let mut temp = tempfile::NamedTempFile::new().unwrap();
        temp.write_all(&vec![1u8; 64 * PAGE as usize]).unwrap();
        temp.as_file().sync_all().unwrap();
        let file = temp.reopen().unwrap();
        // Clean pages of a synced file are dropped by POSIX_FADV_DONTNEED.
        rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::DontNeed).unwrap();
        assert!(!cached(&file, 0, 64 * PAGE), "dropped from the page cache");
    }
}
