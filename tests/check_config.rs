//! `larder check-config` on configs a user gets wrong in ways that matter
//! for security, run as a user runs it (the binary, in the config's own
//! folder): what it prints, and that the security guide (docs/security.md)
//! shows exactly that.

use std::path::Path;
use std::process::Output;

mod common;

/// Runs `larder check-config --config <name>` in `dir`.
fn check_config(dir: &Path, name: &str) -> Output {
    std::process::Command::new(common::larder::binary())
        .args(["check-config", "--config", name])
        .current_dir(dir)
        .output()
        .expect("run larder check-config")
}

/// The security guide, where these messages are shown.
fn guide() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/security.md"))
        .expect("read docs/security.md")
}

#[test]
fn a_via_upstream_with_credentials_is_refused_naming_both_keys() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("hub-password"), "registry-password\n").unwrap();
    let node = "[[upstream]]\nname = \"docker.io\"\nurl = \"https://registry-1.docker.io\"\n\
                via = \"http://larder-hub:5000\"\nusername = \"bot\"\npassword_file = \"hub-password\"\n";
    std::fs::write(dir.path().join("node.toml"), node).unwrap();
    let out = check_config(dir.path(), "node.toml");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("`upstream[0].via`") && stderr.contains("`upstream[0].username`"), "{stderr}");
    assert!(!stderr.contains("registry-password"));
    assert!(guide().contains(stderr.trim_end()), "docs/security.md shows this message:\n{stderr}");
}

#[test]
fn a_fallback_on_another_site_is_warned_about_and_pulls_anonymously() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("hub-token"), "dckr_pat_secret\n").unwrap();
    let hub = "[[upstream]]\nname = \"docker.io\"\nusername = \"bot\"\npassword_file = \"hub-token\"\n\
               urls = [\"https://registry-1.docker.io\", \"https://mirror.gcr.io\"]\n";
    std::fs::write(dir.path().join("hub.toml"), hub).unwrap();
    let out = check_config(dir.path(), "hub.toml");
    assert!(out.status.success(), "{out:?}");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(stderr.contains("warning: `upstream[0].urls[1]`"), "{stderr}");
    let guide = guide();
    assert!(guide.contains(stderr.trim_end()), "docs/security.md shows the warning:\n{stderr}");
    assert!(guide.contains(stdout.trim_end()), "docs/security.md shows the verdict:\n{stdout}");
}

#[test]
fn a_typo_of_a_secret_key_names_the_key_and_never_the_value() {
    let dir = tempfile::tempdir().unwrap();
    let config = "[[upstream]]\nname = \"q.io\"\nurl = \"https://q.io\"\nusername = \"bob\"\npasword = \"hunter2\"\n";
    std::fs::write(dir.path().join("larder.toml"), config).unwrap();
    let out = check_config(dir.path(), "larder.toml");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("hunter2"), "{stderr}");
    let (first, snippet) = stderr.trim_end().split_once('\n').expect("a message and a snippet line");
    let shown = first.split("expected one of").next().unwrap();
    assert_eq!(shown, "larder: larder.toml: line 5, column 1, key `upstream[0].pasword`: unknown field `pasword`, ");
    assert_eq!(snippet, "  5 | pasword = …");
    let guide = guide();
    assert!(guide.contains(shown) && guide.contains(snippet), "docs/security.md shows this message:\n{stderr}");
}
