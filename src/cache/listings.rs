//! `tags/list` and `referrers`: one upstream request per page however
//! many ask, each page cached under its query and served stale when
//! upstream fails; tag lists paginated by larder when upstream does not.

use std::sync::Arc;

use super::*;
use crate::oci::referrers::{self, ReferrersIndex};

/// A `tags/list` page as the client asked for it: upstream's own when it
/// paginated (sent a `Link`) or already fits, else sorted and cut to the
/// client's `n` after its `last`, with a `Link` to the next page.
fn paginate_tags(page: Page, repo: &RepoName, query: Option<&str>) -> Page {
    if page.link.is_some() {
        return page;
    }
    let want = tag_list::Pagination::from_query(query);
    let Some(paginated) = tag_list::paginate(&page.body, &want) else { return page };
    let link = paginated
        .next_last
        .and_then(|last| http::HeaderValue::from_str(&tag_list::next_link(repo.as_str(), want.n, &last)).ok());
    Page { body: Bytes::from(paginated.body), link, ..page }
}

impl Cache {
    /// A page of `tags/list` or `referrers`: cached in memory for the
    /// upstream's tag TTL, fetched once however many ask, and served stale
    /// (up to `stale_if_error`) when upstream fails. Each query is its own
    /// page; a tag list upstream did not paginate is sorted and paginated
    /// here ([`crate::oci::tag_list`]). Upstream's 404 to a tag list is a
    /// 404; to referrers it means the registry has no referrers API, and
    /// larder answers from the `sha256-<hex>` fallback tag itself
    /// (`referrers_from_tag` below).
    pub async fn listing(
        self: &Arc<Self>,
        upstream: &Arc<Upstream>,
        repo: &RepoName,
        listing: &Listing,
        query: Option<&str>,
        via: Via,
    ) -> Result<(Page, CacheResult), Error> {
        let what = match listing {
            Listing::Tags => "tags".to_owned(),
            Listing::Referrers(d) => format!("referrers/{d}"),
        };
        let key = format!("{}\0{repo}\0{what}\0{}", upstream.name(), query.unwrap_or(""));
        let fallback_key = format!("{key}\0fallback");
        let (page, result) = match (self.upstream_page(upstream, repo, listing, query, &key, &what).await, listing) {
            (Ok(answer), _) => answer,
            // Upstream is down and nothing of its answer is cached (a
            // restart during an outage): a fallback tag larder holds still
            // answers. Not when upstream answered wrongly: that is a 502.
            (
                Err(Error::Upstream(
                    e @ (UpstreamError::Connect(_)
                    | UpstreamError::Timeout(_)
                    | UpstreamError::Status { .. }
                    | UpstreamError::RateLimited { .. }),
                )),
                Listing::Referrers(subject),
            ) => {
                return self
                    .referrers_from_tag(upstream, repo, subject, query, via, &fallback_key)
                    .await
                    .map_err(|_| Error::Upstream(e));
            }
            (Err(e), _) => return Err(e),
        };
        match (page, listing) {
            (Some(page), _) => Ok((page, result)),
            (None, Listing::Tags) => Err(Error::NameUnknown),
            (None, Listing::Referrers(subject)) => {
                self.referrers_from_tag(upstream, repo, subject, query, via, &fallback_key).await
            }
        }
    }

    /// Upstream's page (`None` for its 404), from memory within the TTL,
    /// else fetched once for everyone asking, else stale.
    async fn upstream_page(
        &self,
        upstream: &Arc<Upstream>,
        repo: &RepoName,
        listing: &Listing,
        query: Option<&str>,
        key: &str,
        what: &str,
    ) -> Result<(Option<Page>, CacheResult), Error> {
        let ttl = upstream.config.tag_ttl(&self.config);
        let cached = self.memory.listing(key);
        if let Some((page, fetched)) = &cached {
            if fetched.elapsed() < ttl {
                return Ok((page.clone(), CacheResult::Hit));
            }
        }
        let fetch = {
            let (upstream, repo, listing, query) =
                (Arc::clone(upstream), repo.clone(), listing.clone(), query.map(str::to_owned));
            move || async move {
                let page = upstream.get_listing(&repo, &listing, query.as_deref()).await?;
                Ok(match (page, &listing) {
                    (Some(page), Listing::Tags) => Some(paginate_tags(page, &repo, query.as_deref())),
                    (page, _) => page,
                })
            }
        };
        let (answer, joined) = self.listing_fetches.run(key.to_owned(), fetch).await;
        match (answer, cached) {
            (Ok(page), _) => {
                self.memory.insert_listing(key.to_owned(), page.clone());
                Ok((page, CacheResult::of(joined)))
            }
            (Err(Error::Upstream(e)), Some((page, fetched)))
                if fetched.elapsed() < ttl + self.config.stale_if_error =>
            {
                tracing::warn!(upstream = upstream.name(), %repo, what, error = %e, "serving a stale listing");
                Ok((page, CacheResult::Stale))
            }
            (Err(e), _) => Err(e),
        }
    }

    /// The referrers of `subject` from a registry without the referrers
    /// API: the image index under its fallback tag (`sha256-<hex>`, where
    /// clients such as oras and notation keep them there), resolved like
    /// any tag — cached, revalidated after the TTL, served stale when
    /// upstream fails — and an empty index when the tag does not exist (a
    /// 404 would tell a client there is no referrers API here; larder has
    /// one). The `artifactType` filter is applied here, and said so with
    /// `OCI-Filters-Applied`. The answer is kept for the TTL under `key`.
    async fn referrers_from_tag(
        self: &Arc<Self>,
        upstream: &Arc<Upstream>,
        repo: &RepoName,
        subject: &Digest,
        query: Option<&str>,
        via: Via,
        key: &str,
    ) -> Result<(Page, CacheResult), Error> {
        if let Some((Some(page), made)) = self.memory.listing(key) {
            if made.elapsed() < upstream.config.tag_ttl(&self.config) {
                return Ok((page, CacheResult::Hit));
            }
        }
        let tag = referrers::fallback_tag(subject);
        let reference = Reference::Tag(tag.parse().map_err(Error::NameInvalid)?);
        let (mut index, result) = match self.manifest_via(upstream, repo, &reference, via).await {
            Ok((m, result)) => {
                let index = ReferrersIndex::parse(&m.bytes).map_err(|why| {
                    tracing::warn!(upstream = upstream.name(), %repo, tag, why, "a referrers fallback tag that is not an image index");
                    Error::Upstream(UpstreamError::Protocol(format!("the referrers fallback tag {tag} is not an image index")))
                })?;
                (index, result)
            }
            Err(Error::ManifestUnknown | Error::NameUnknown) => (ReferrersIndex::empty(), CacheResult::Miss),
            Err(e) => return Err(e),
        };
        let artifact_type = form_urlencoded::parse(query.unwrap_or_default().as_bytes())
            .find(|(k, _)| k == "artifactType")
            .map(|(_, v)| v.into_owned());
        if let Some(t) = &artifact_type {
            index.filter(t);
        }
        let page = Page {
            body: Bytes::from(index.to_bytes()),
            content_type: http::HeaderValue::from_static(crate::oci::MediaType::OciIndex.as_str()),
            link: None,
            filters_applied: artifact_type.map(|_| http::HeaderValue::from_static("artifactType")),
        };
        self.memory.insert_listing(key.to_owned(), Some(page.clone()));
        Ok((page, result))
    }
}
