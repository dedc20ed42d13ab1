//! Manifest media types and `Accept` negotiation.

use http::HeaderMap;
use http::header::ACCEPT;

/// The manifest media types larder stores and serves.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum MediaType {
    OciManifest,
    OciIndex,
    DockerManifest,
    DockerManifestList,
}

impl MediaType {
    pub const ALL: [MediaType; 4] =
        [MediaType::OciIndex, MediaType::OciManifest, MediaType::DockerManifestList, MediaType::DockerManifest];

    pub fn as_str(self) -> &'static str {
        match self {
            MediaType::OciManifest => "application/vnd.oci.image.manifest.v1+json",
            MediaType::OciIndex => "application/vnd.oci.image.index.v1+json",
            MediaType::DockerManifest => "application/vnd.docker.distribution.manifest.v2+json",
            MediaType::DockerManifestList => "application/vnd.docker.distribution.manifest.list.v2+json",
        }
    }

    pub fn parse(s: &str) -> Option<MediaType> {
        let essence = s.split(';').next().unwrap_or("").trim();
        MediaType::ALL.into_iter().find(|m| m.as_str().eq_ignore_ascii_case(essence))
    }

    /// The `Accept` value larder sends upstream: every type it can store.
    pub fn upstream_accept() -> &'static str {
        "application/vnd.oci.image.index.v1+json, application/vnd.oci.image.manifest.v1+json, \
         application/vnd.docker.distribution.manifest.list.v2+json, \
         application/vnd.docker.distribution.manifest.v2+json"
    }
}

/// What a client said it accepts. Clients send one media type per `Accept`
/// line (skopeo, podman), a comma-separated list (containerd), or nothing.
#[derive(Debug, Clone)]
pub struct Accept {
    /// `None`: no usable `Accept` (absent, or only wildcards), which
    /// registries treat as "anything".
    types: Option<Vec<MediaType>>,
}

impl Accept {
    pub fn from_headers(headers: &HeaderMap) -> Accept {
        let mut types = Vec::new();
        let mut wildcard = false;
        let mut any_line = false;
        for value in headers.get_all(ACCEPT) {
            let Ok(value) = value.to_str() else { continue };
            for item in value.split(',') {
                let item = item.trim();
                if item.is_empty() {
                    continue;
                }
                any_line = true;
                let essence = item.split(';').next().unwrap_or("").trim();
                if essence == "*/*" || essence == "application/*" {
                    wildcard = true;
                } else if let Some(m) = MediaType::parse(essence) {
                    types.push(m);
                }
            }
        }
        // Only wildcards, or only types we don't know (e.g. "application/json"
        // from curl): be as lenient as distribution is.
        if !any_line || wildcard || types.is_empty() { Accept { types: None } } else { Accept { types: Some(types) } }
    }

    pub fn allows(&self, media: MediaType) -> bool {
        match &self.types {
            None => true,
            Some(types) => types.contains(&media),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(lines: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for l in lines {
            h.append(ACCEPT, HeaderValue::from_str(l).unwrap());
        }
        h
    }

    #[test]
    fn one_type_per_line_like_skopeo() {
        let a = Accept::from_headers(&headers(&[
            "application/vnd.oci.image.manifest.v1+json",
            "application/vnd.docker.distribution.manifest.v2+json",
        ]));
        assert!(a.allows(MediaType::OciManifest));
        assert!(a.allows(MediaType::DockerManifest));
        assert!(!a.allows(MediaType::OciIndex));
    }

    #[test]
    fn comma_list_like_containerd() {
        let a = Accept::from_headers(&headers(&[
            "application/vnd.docker.distribution.manifest.v2+json, application/vnd.oci.image.index.v1+json, */*;q=0.8",
        ]));
        assert!(a.allows(MediaType::OciIndex));
        let a = Accept::from_headers(&headers(&[
            "application/vnd.docker.distribution.manifest.v2+json, application/vnd.docker.distribution.manifest.list.v2+json",
        ]));
        assert!(!a.allows(MediaType::OciIndex));
        assert!(!a.allows(MediaType::OciManifest));
        assert!(a.allows(MediaType::DockerManifestList));
    }

    #[test]
    fn absent_or_unknown_accept_allows_anything() {
        assert!(Accept::from_headers(&HeaderMap::new()).allows(MediaType::OciIndex));
        assert!(Accept::from_headers(&headers(&["application/json"])).allows(MediaType::OciIndex));
    }

    #[test]
    fn media_type_parameters_are_ignored() {
        assert_eq!(
            MediaType::parse("application/vnd.oci.image.index.v1+json; charset=utf-8"),
            Some(MediaType::OciIndex)
        );
        assert_eq!(MediaType::parse("text/plain"), None);
    }
}
