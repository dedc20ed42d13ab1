//! The scope of a token request: what larder asks a realm to let it do.
//! Always `repository:<name>:pull` for the repository in the path of the
//! request that got the 401 (after redirects: registry.k8s.io sends
//! manifests to Artifact Registry under a rewritten name), plus the
//! challenge's own scopes when they name that same repository or are not
//! repository scopes at all (public.ecr.aws asks for `aws`). A challenge
//! can never widen a token to another repository.

use crate::oci::RepoName;

/// The endpoints of the distribution API whose path names a repository.
const REPOSITORY_ENDPOINTS: [&str; 4] = ["/manifests/", "/blobs/", "/tags/list", "/referrers/"];

/// The scopes of one token request, in the order they are sent; also the
/// cache key's scope part.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Scopes(Vec<String>);

impl Scopes {
    /// The scopes for a 401 on a request for `name` (`None`: the path names
    /// no repository), given the challenge's `scope` parameter.
    pub fn new(name: Option<&RepoName>, challenge_scope: Option<&str>) -> Scopes {
        let mut scopes: Vec<String> = name.map(|n| format!("repository:{n}:pull")).into_iter().collect();
        for scope in challenge_scope.unwrap_or_default().split_ascii_whitespace() {
            let wanted = match repository_scope_name(scope) {
                Some(named) => name.is_some_and(|n| n.as_str() == named),
                None => true,
            };
            if wanted && !scopes.iter().any(|s| s == scope) {
                scopes.push(scope.to_owned());
            }
        }
        Scopes(scopes)
    }

    pub fn iter(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(String::as_str)
    }

    /// Bytes held, for the token cache's weight.
    pub fn len_bytes(&self) -> usize {
        self.0.iter().map(String::len).sum()
    }
}

/// The repository a distribution API path names: `/v2/<name>/manifests/…`,
/// `/blobs/…`, `/tags/list`, `/referrers/…`. `None` for anything else (a
/// CDN's path), or a name that is not valid.
pub fn repository_of(path: &str) -> Option<RepoName> {
    let rest = path.strip_prefix("/v2/")?;
    let end = REPOSITORY_ENDPOINTS.iter().filter_map(|e| rest.rfind(e)).max()?;
    rest[..end].parse().ok()
}

/// The name of a repository scope (`repository:<name>:<actions>`, also
/// `repository(plugin):…`); `None` for a scope of another type.
fn repository_scope_name(scope: &str) -> Option<&str> {
    let (kind, rest) = scope.split_once(':')?;
    if !kind.starts_with("repository") {
        return None;
    }
    // The name itself has no colon; the actions come after the last one.
    Some(rest.rsplit_once(':').map_or(rest, |(name, _)| name))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repo(s: &str) -> RepoName {
        s.parse().unwrap()
    }

    #[test]
    fn the_repository_comes_from_the_path() {
        assert_eq!(repository_of("/v2/library/alpine/manifests/3"), Some(repo("library/alpine")));
        assert_eq!(
            repository_of("/v2/k8s-artifacts-prod/images/pause/manifests/3.9"),
            Some(repo("k8s-artifacts-prod/images/pause"))
        );
        assert_eq!(repository_of("/v2/a/b/blobs/sha256:00"), Some(repo("a/b")));
        assert_eq!(repository_of("/v2/a/tags/list"), Some(repo("a")));
        // A repository may itself be called "blobs".
        assert_eq!(repository_of("/v2/x/blobs/manifests/v1"), Some(repo("x/blobs")));
        assert_eq!(repository_of("/artifacts-downloads/abc"), None);
        assert_eq!(repository_of("/v2/"), None);
        assert_eq!(repository_of("/v2/UPPER/manifests/x"), None);
    }

    #[test]
    fn challenge_scopes_are_added_only_for_the_same_repository_or_other_types() {
        let app = repo("team/app");
        let s = Scopes::new(Some(&app), Some("repository:team/app:pull"));
        assert_eq!(s.iter().collect::<Vec<_>>(), ["repository:team/app:pull"]);
        let s = Scopes::new(Some(&app), Some("repository:team/app:pull,push aws"));
        assert_eq!(s.iter().collect::<Vec<_>>(), ["repository:team/app:pull", "repository:team/app:pull,push", "aws"]);
        // Another repository is never added: the path decides.
        let s = Scopes::new(Some(&app), Some("repository:team/secret:pull repository(plugin):other:pull"));
        assert_eq!(s.iter().collect::<Vec<_>>(), ["repository:team/app:pull"]);
        // No repository in the path: only scopes of other types.
        let s = Scopes::new(None, Some("repository:team/app:pull registry:catalog:*"));
        assert_eq!(s.iter().collect::<Vec<_>>(), ["registry:catalog:*"]);
        assert_eq!(Scopes::new(None, None).iter().count(), 0);
    }
}
