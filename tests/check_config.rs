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

/// docs/configuration.md, where sizes and durations are described.
fn configuration_guide() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/configuration.md"))
        .expect("read docs/configuration.md")
}

/// Sizes and durations are read as docs/configuration.md lists them: a
/// lone `G` is refused with both meanings, near misses with what to write,
/// each watermark under its own key, and `check-config` shows every size
/// it read in bytes.
#[test]
fn sizes_mean_one_thing_and_check_config_shows_them_in_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let write = |cache: &str| {
        let text = format!("[cache]\n{cache}\n[[upstream]]\nname = \"q.io\"\nurl = \"https://q.io\"\n");
        std::fs::write(dir.path().join("larder.toml"), text).unwrap();
        check_config(dir.path(), "larder.toml")
    };
    let refused = |cache: &str| {
        let out = write(cache);
        assert_eq!(out.status.code(), Some(2), "{cache}: {out:?}");
        String::from_utf8_lossy(&out.stderr).trim_end().to_owned()
    };

    let ambiguous = refused("max_size = \"50G\"");
    assert_eq!(
        ambiguous,
        "larder: larder.toml: `cache.max_size`: \"50G\" is ambiguous: write \"50GiB\" (53687091200 bytes) or \
         \"50GB\" (50000000000 bytes)"
    );
    assert!(configuration_guide().contains(&ambiguous), "docs/configuration.md shows:\n{ambiguous}");
    for (cache, says) in [
        ("max_size = \"50 GiB\"", "`cache.max_size`: \"50 GiB\": write \"50GiB\" ("),
        ("max_size = \"50Gi\"", "`cache.max_size`: \"50Gi\": write \"50GiB\" ("),
        ("memory = \"1.5GiB\"", "`cache.memory`: \"1.5GiB\": write \"1536MiB\" ("),
        ("tag_ttl = \"7 days\"", "`cache.tag_ttl`: \"7 days\": write \"7d\" ("),
        ("tag_ttl = \"5 minutes\"", "`cache.tag_ttl`: \"5 minutes\": write \"5m\" ("),
        ("stale_if_error = \"1.5h\"", "`cache.stale_if_error`: \"1.5h\": write \"90m\" ("),
        (
            "low_watermark = 0.97",
            "`cache.low_watermark`: must be above 0 and below cache.high_watermark (0.95), not 0.97",
        ),
        ("high_watermark = 1.2", "`cache.high_watermark`: must be above 0 and at most 1, not 1.2"),
        (
            "max_size = \"512KiB\"",
            "`cache.max_size`: 512 KiB (524288 bytes) is less than the minimum, 1 MiB (1048576 bytes)",
        ),
    ] {
        let e = refused(cache);
        assert!(e.contains(says), "{cache}: {e}");
    }

    let out = write("max_size = \"50GiB\"\nmemory = \"512MiB\"\ntag_ttl = \"10m\"");
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let cache = stdout.lines().nth(1).expect("a cache line after the verdict");
    assert_eq!(
        cache,
        "cache: 50 GiB (53687091200 bytes) in ./larder-data, evicting above 95% down to 85% of it; memory 512 MiB \
         (536870912 bytes); tags trusted 10m, served stale up to 7d more when upstream fails"
    );
}

/// Two things `check-config` can know from the config alone: a grant
/// naming a user the htpasswd file lacks gives nothing, and HTTP Basic
/// without TLS sends passwords in the clear. docs/access.md shows both.
#[test]
fn a_grant_user_without_a_password_and_passwords_in_the_clear_are_warned_about() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("htpasswd"),
        "team-a:$2y$05$6ZlIhc8Bm2mXfBSkCdNYqOX7B1jKc9nBVIIyFU8n7aQ.DOyICtyRW\n",
    )
    .unwrap();
    let text = "[server]\nlisten = \"0.0.0.0:5000\"\n[server.auth]\nhtpasswd = \"htpasswd\"\n\
                [[server.auth.grant]]\nwho = [\"team-a\", \"team-b\"]\n\
                [[upstream]]\nname = \"ghcr.io\"\nurl = \"https://ghcr.io\"\n";
    std::fs::write(dir.path().join("tenants.toml"), text).unwrap();
    let out = check_config(dir.path(), "tenants.toml");
    assert!(out.status.success(), "warnings, not errors: {out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 2, "{stderr}");
    assert!(
        lines[0].starts_with(
            "larder: tenants.toml: warning: `server.auth.grant[0].who`: user \"team-b\" is in no password file"
        ),
        "{stderr}"
    );
    assert!(
        lines[1].starts_with(
            "larder: tenants.toml: warning: `server.auth.htpasswd`: clients send their passwords in the clear"
        ),
        "{stderr}"
    );
    let guide = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/access.md")).unwrap();
    for line in &lines {
        assert!(guide.contains(line), "docs/access.md shows:\n{line}");
    }
}

/// `--without-secrets` opens no file that holds secrets, the htpasswd
/// file's password hashes included: the grant users it would check there
/// are listed as not checked, never warned about from the file.
#[test]
fn without_secrets_the_htpasswd_file_is_not_read_for_the_grant_users() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("htpasswd"),
        "team-a:$2y$05$6ZlIhc8Bm2mXfBSkCdNYqOX7B1jKc9nBVIIyFU8n7aQ.DOyICtyRW\n",
    )
    .unwrap();
    let text = "[server]\nlisten = \"127.0.0.1:5000\"\n[server.auth]\nhtpasswd = \"htpasswd\"\n\
                [[server.auth.grant]]\nwho = [\"team-b\"]\n\
                [[upstream]]\nname = \"ghcr.io\"\nurl = \"https://ghcr.io\"\n";
    std::fs::write(dir.path().join("tenants.toml"), text).unwrap();
    let out = std::process::Command::new(common::larder::binary())
        .args(["check-config", "--without-secrets", "--config", "tenants.toml"])
        .current_dir(dir.path())
        .output()
        .expect("run larder check-config");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stdout}{stderr}");
    assert!(
        !stderr.contains("is in no password file"),
        "a warning read from the htpasswd file, which --without-secrets does not open:\n{stderr}"
    );
    assert!(stdout.contains("not checked: `server.auth.htpasswd`: htpasswd was not opened"), "{stdout}");
    assert!(
        stdout.contains("not checked: that the users [[server.auth.grant]] names are in server.auth.htpasswd"),
        "{stdout}"
    );
}

/// Every config shipped in config/ passes `check-config --without-secrets`
/// where its secret files and the pod's environment are absent (a config
/// repository's CI), and lists what it did not check: each key that fails
/// without the flag is among them.
#[test]
fn every_shipped_config_checks_without_its_secrets_and_says_what_it_skipped() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut configs = Vec::new();
    for dir in ["config", "config/registries"] {
        for entry in std::fs::read_dir(root.join(dir)).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                configs.push(path);
            }
        }
    }
    configs.sort();
    let run = |path: &Path, extra: &[&str]| {
        let mut command = std::process::Command::new(common::larder::binary());
        command.arg("check-config").args(extra).arg("--config").arg(path.file_name().unwrap());
        for var in ["POD_IP", "POD_NAMESPACE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"] {
            command.env_remove(var);
        }
        command.current_dir(path.parent().unwrap()).output().expect("run larder check-config")
    };
    let mut needed = Vec::new();
    for path in &configs {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let out = run(path, &["--without-secrets"]);
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success(), "{name}: {stdout}{}", String::from_utf8_lossy(&out.stderr));
        assert!(stdout.starts_with(&format!("{name}: ok without its secrets (")), "{stdout}");
        let plain = run(path, &[]);
        if plain.status.success() {
            assert!(!stdout.contains("not checked: "), "{name} needs nothing here, and skips nothing:\n{stdout}");
            continue;
        }
        let e = String::from_utf8_lossy(&plain.stderr);
        let key = e.split('`').nth(1).unwrap_or_else(|| panic!("{name}: an error naming a key: {e}"));
        assert!(stdout.contains(&format!("not checked: `{key}`: ")), "{name}: {key} is listed as skipped:\n{stdout}");
        needed.push(name);
    }
    println!(
        "{} configs; {} need their secrets to pass without --without-secrets: {needed:?}",
        configs.len(),
        needed.len()
    );
    assert_eq!(configs.len(), 16);
    assert!(needed.iter().any(|n| n == "cluster.toml"), "{needed:?}");
}
