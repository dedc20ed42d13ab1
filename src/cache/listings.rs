//! `tags/list` and `referrers`: one upstream request per page however
//! many ask, each page cached under its query and served stale when
//! upstream fails; tag lists paginated by larder when upstream does not.

use std::sync::Arc;

use super::*;

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
    /// (up to `stale_if_error`) when upstream fails. Upstream's 404 is
    /// cached and answered as a 404 too: for referrers it means "no
    /// referrers API", and clients then use the `sha256-<hex>` fallback
    /// tag, which an empty 200 would hide from them. Each query is its own
    /// page; a tag list upstream did not paginate is sorted and paginated
    /// here ([`crate::oci::tag_list`]).
    pub async fn listing(
        &self,
        upstream: &Arc<Upstream>,
        repo: &RepoName,
        listing: &Listing,
        query: Option<&str>,
    ) -> Result<(Page, CacheResult), Error> {
        let what = match listing {
            Listing::Tags => "tags".to_owned(),
            Listing::Referrers(d) => format!("referrers/{d}"),
        };
        let key = format!("{}\0{repo}\0{what}\0{}", upstream.name(), query.unwrap_or(""));
        let ttl = upstream.config.tag_ttl(&self.config);
        let not_found = || match listing {
            Listing::Tags => Error::NameUnknown,
            Listing::Referrers(_) => Error::NotFound,
        };
        let cached = self.memory.listing(&key);
        if let Some((page, fetched)) = &cached {
            if fetched.elapsed() < ttl {
                return page.clone().map(|p| (p, CacheResult::Hit)).ok_or_else(not_found);
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
        let (answer, joined) = self.listing_fetches.run(key.clone(), fetch).await;
        match (answer, cached) {
            (Ok(page), _) => {
                self.memory.insert_listing(key, page.clone());
                page.map(|p| (p, CacheResult::of(joined))).ok_or_else(not_found)
            }
            (Err(Error::Upstream(e)), Some((page, fetched)))
                if fetched.elapsed() < ttl + self.config.stale_if_error =>
            {
                tracing::warn!(upstream = upstream.name(), %repo, what, error = %e, "serving a stale listing");
                page.map(|p| (p, CacheResult::Stale)).ok_or_else(not_found)
            }
            (Err(e), _) => Err(e),
        }
    }
}
