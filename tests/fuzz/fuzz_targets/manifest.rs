//! `inspect_manifest` on arbitrary bytes, under every declared
//! `Content-Type` and none: no panic; the result agrees with the declared
//! type; one platform slot per child manifest; the declared type only
//! decides when the JSON names none itself.
#![no_main]

use larder::oci::{Digest, MediaType, inspect_manifest};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let undeclared = inspect_manifest(data, None);
    let mut accepted = Vec::new();
    for declared in MediaType::ALL {
        let Ok((media, refs)) = inspect_manifest(data, Some(declared)) else { continue };
        assert_eq!(media, declared);
        assert_eq!(refs.platforms.len(), refs.manifests.len());
        for d in refs.blobs.iter().chain(&refs.manifests) {
            assert_eq!(d.to_string().parse::<Digest>().as_ref(), Ok(d));
        }
        if let Some(p) = refs.platforms.iter().flatten().next() {
            assert!(p.matches('/').count() >= 1, "platform {p:?}");
        }
        accepted.push((media, refs));
    }
    match &undeclared {
        // The JSON names its type: exactly that type is accepted when declared, with the same references.
        Ok((media, refs)) => {
            assert_eq!(accepted.len(), 1, "embedded {media:?}, yet accepted as {:?}", accepted);
            assert_eq!(&accepted[0].0, media);
            assert_eq!(&accepted[0].1, refs);
        }
        // Refused undeclared: the JSON names no type (then any declared type
        // goes, with the same references) or the bytes are bad (then none does).
        Err(_) => assert!(
            accepted.is_empty()
                || (accepted.len() == MediaType::ALL.len() && accepted.windows(2).all(|w| w[0].1 == w[1].1)),
            "refused undeclared, accepted as {:?}",
            accepted.iter().map(|a| a.0).collect::<Vec<_>>()
        ),
    }
});
