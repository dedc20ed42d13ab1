//! `tags/list` as the OCI distribution spec has it: tags in lexical order,
//! at most `n` of them, only those after `last`, and a `Link` to the next
//! page. Some registries (distribution 2.8 among them) ignore `n` and
//! `last` and answer unsorted; larder then paginates their answer itself.
//! Pure functions, no I/O.

use serde::{Deserialize, Serialize};

/// The pagination a client asked for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pagination {
    pub n: Option<usize>,
    pub last: Option<String>,
}

impl Pagination {
    /// From a query string (`n=10&last=v2`); other parameters are ignored,
    /// and an `n` that is not a number is as if absent.
    pub fn from_query(query: Option<&str>) -> Pagination {
        let mut p = Pagination::default();
        for (k, v) in form_urlencoded::parse(query.unwrap_or_default().as_bytes()) {
            match k.as_ref() {
                "n" => p.n = v.parse().ok(),
                "last" => p.last = Some(v.into_owned()),
                _ => {}
            }
        }
        p
    }
}

#[derive(Deserialize, Serialize)]
struct TagList {
    name: String,
    #[serde(default, deserialize_with = "null_as_empty")]
    tags: Vec<String>,
}

fn null_as_empty<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    Ok(Option::<Vec<String>>::deserialize(d)?.unwrap_or_default())
}

/// Upstream's `tags/list` answer, checked and written anew (`name` and
/// `tags`, nothing else), so that whatever else a body holds (an answer
/// from somewhere a redirect led) never reaches a client; an error says why
/// it is not a tag list.
pub fn reserialize(body: &[u8]) -> Result<Vec<u8>, String> {
    let list: TagList = serde_json::from_slice(body).map_err(|e| format!("not a tag list: {e}"))?;
    serde_json::to_vec(&list).map_err(|e| e.to_string())
}

/// A page larder built from upstream's answer.
#[derive(Debug, PartialEq, Eq)]
pub struct Paginated {
    pub body: Vec<u8>,
    /// The `last` of the next page, when tags remain after this one.
    pub next_last: Option<String>,
}

/// For a page upstream sent without a `Link` (so not paginated by it):
/// `None` if it already is what the client asked for (sorted, at most `n`
/// tags, all after `last`) or is not a tag list at all, to be relayed as
/// it is; otherwise upstream's tags sorted, filtered and cut to `n`.
pub fn paginate(body: &[u8], want: &Pagination) -> Option<Paginated> {
    let mut list: TagList = serde_json::from_slice(body).ok()?;
    let sorted = list.tags.windows(2).all(|w| w[0] < w[1]);
    let within_n = want.n.is_none_or(|n| list.tags.len() <= n);
    let after_last = want.last.as_ref().is_none_or(|last| list.tags.iter().all(|t| t > last));
    if sorted && within_n && after_last {
        return None;
    }
    list.tags.sort();
    list.tags.dedup();
    if let Some(last) = &want.last {
        list.tags.retain(|t| t > last);
    }
    let mut next_last = None;
    if let Some(n) = want.n {
        if list.tags.len() > n {
            list.tags.truncate(n);
            // n = 0 asks for nothing; there is no page after "nothing".
            next_last = list.tags.last().cloned();
        }
    }
    let body = serde_json::to_vec(&list).ok()?;
    Some(Paginated { body, next_last })
}

/// The `Link` header value for the page after `last`, on upstream's path
/// (the handler rewrites it onto the client's).
pub fn next_link(repo: &str, n: Option<usize>, last: &str) -> String {
    let mut query = form_urlencoded::Serializer::new(String::new());
    if let Some(n) = n {
        query.append_pair("n", &n.to_string());
    }
    query.append_pair("last", last);
    format!("</v2/{repo}/tags/list?{}>; rel=\"next\"", query.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tags(p: &Paginated) -> Vec<String> {
        let v: serde_json::Value = serde_json::from_slice(&p.body).unwrap();
        v["tags"].as_array().unwrap().iter().map(|t| t.as_str().unwrap().to_owned()).collect()
    }

    const UNSORTED: &[u8] = br#"{"name":"team/app","tags":["v3","latest","v1","v2"]}"#;

    #[test]
    fn an_ignoring_upstream_is_sorted_and_paginated() {
        let first = paginate(UNSORTED, &Pagination::from_query(Some("n=2"))).unwrap();
        assert_eq!(tags(&first), ["latest", "v1"]);
        assert_eq!(first.next_last.as_deref(), Some("v1"));
        let second = paginate(UNSORTED, &Pagination::from_query(Some("n=2&last=v1"))).unwrap();
        assert_eq!(tags(&second), ["v2", "v3"]);
        assert_eq!(second.next_last, None, "nothing after v3");
        let all = paginate(UNSORTED, &Pagination::default()).unwrap();
        assert_eq!(tags(&all), ["latest", "v1", "v2", "v3"]);
        let none = paginate(UNSORTED, &Pagination::from_query(Some("n=0"))).unwrap();
        assert!(tags(&none).is_empty());
        assert_eq!(none.next_last, None);
    }

    #[test]
    fn a_page_that_already_fits_is_relayed() {
        let sorted = br#"{"name":"a","tags":["a","b"]}"#;
        assert_eq!(paginate(sorted, &Pagination::from_query(Some("n=2"))), None);
        assert_eq!(paginate(sorted, &Pagination::default()), None);
        assert_eq!(paginate(br#"{"name":"a","tags":null}"#, &Pagination::default()), None);
        assert_eq!(paginate(b"not json", &Pagination::from_query(Some("n=1"))), None);
    }

    #[test]
    fn a_tag_list_is_written_anew_and_anything_else_refused() {
        let out = reserialize(br#"{"name":"team/app","tags":["v1"],"child":["x"],"note":"dropped"}"#).unwrap();
        assert_eq!(out, br#"{"name":"team/app","tags":["v1"]}"#);
        assert_eq!(reserialize(br#"{"name":"a","tags":null}"#).unwrap(), br#"{"name":"a","tags":[]}"#);
        let metadata = br#"{"Code":"Success","AccessKeyId":"ASIA","SecretAccessKey":"s3cret","Token":"t"}"#;
        for body in [&metadata[..], b"not json", br#"{"name":"a","tags":[1]}"#, br#"{"tags":["v1"]}"#, b"[]"] {
            assert!(reserialize(body).is_err(), "{}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn links_name_the_next_page() {
        assert_eq!(next_link("team/app", Some(2), "v 1"), "</v2/team/app/tags/list?n=2&last=v+1>; rel=\"next\"");
    }
}
