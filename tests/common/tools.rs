//! Small helpers every peer needs: free loopback ports and finding binaries.

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, TcpListener};
use std::path::PathBuf;
use std::sync::Mutex;

/// A TCP port on 127.0.0.1 that was free a moment ago, and that this test
/// process has not handed out before.
///
/// The port is released before it is returned, so another process could take
/// it first; for peers that cannot be handed a bound socket this is the best
/// a test can do, and the window is tiny. Within one test binary the kernel
/// does hand the same ephemeral port out again once it is released (a Garage
/// node once got, as its admin port, the port another node's S3 API had just
/// been given), so every port returned is remembered and never returned twice.
pub fn free_port() -> u16 {
    static GIVEN: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
    loop {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .unwrap_or_else(|e| panic!("cannot bind 127.0.0.1:0 to find a free port: {e}"));
        let port = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("bound 127.0.0.1:0 but cannot read its address: {e}"))
            .port();
        if GIVEN.lock().unwrap_or_else(|e| e.into_inner()).insert(port) {
            return port;
        }
    }
}

/// The full path of `binary` on `PATH`; panics with what to do when missing.
pub fn which(binary: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).map(|dir| dir.join(binary)).find(|candidate| is_executable(candidate)).unwrap_or_else(
        || {
            panic!(
                "`{binary}` is not on PATH; run tests/run.sh, which installs \
                 docker-registry and skopeo"
            )
        },
    )
}

fn is_executable(path: &std::path::Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).map(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0).unwrap_or(false)
}
