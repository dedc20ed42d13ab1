//! `Digest`, `RepoName`, `Tag` and `Reference` from arbitrary text: no panic,
//! and whatever parses is canonical (prints back as the input, parses again
//! to the same value) and obeys the OCI grammar.
#![no_main]

use larder::oci::{Digest, Reference, RepoName, Tag};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else { return };

    let digest = s.parse::<Digest>();
    if let Ok(d) = &digest {
        // sha256:<64 lowercase hex> is the only accepted form, so it is canonical.
        assert_eq!(d.to_string(), s);
        assert_eq!(d.hex().len(), 64);
        assert_eq!(d.to_string().parse::<Digest>().as_ref(), Ok(d));
    }

    if let Ok(name) = s.parse::<RepoName>() {
        assert_eq!(name.as_str(), s);
        assert!(!s.is_empty() && s.len() <= 255, "name length {}", s.len());
        assert!(
            s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-/".contains(&b)),
            "name has a byte outside [a-z0-9._/-]: {s:?}"
        );
        for component in s.split('/') {
            let (first, last) = (component.as_bytes()[0], component.as_bytes()[component.len() - 1]);
            assert!(first.is_ascii_alphanumeric() && last.is_ascii_alphanumeric(), "component {component:?}");
            assert!(!component.contains("..") && !component.contains("___"), "component {component:?}");
        }
        assert_eq!(name.components(), s.split('/').count());
        assert_eq!(name.to_string().parse::<RepoName>().as_ref(), Ok(&name));
        match name.in_library() {
            Ok(library) => assert_eq!(library.as_str(), format!("library/{s}")),
            Err(_) => assert!(s.len() + "library/".len() > 255, "in_library refused a short name {s:?}"),
        }
    }

    let tag = s.parse::<Tag>();
    if let Ok(t) = &tag {
        assert_eq!(t.as_str(), s);
        assert!(!s.is_empty() && s.len() <= 128, "tag length {}", s.len());
        assert!(s.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)), "tag {s:?}");
        assert!(!s.starts_with(['.', '-']), "tag {s:?}");
    }

    match s.parse::<Reference>() {
        Ok(r) => {
            assert_eq!(r.to_string(), s);
            match &r {
                Reference::Digest(d) => assert_eq!(digest.as_ref(), Ok(d)),
                Reference::Tag(t) => assert_eq!(tag.as_ref().ok(), Some(t)),
            }
        }
        // A reference is a digest when it has a ':', else a tag.
        Err(_) => assert!(if s.contains(':') { digest.is_err() } else { tag.is_err() }),
    }
});
