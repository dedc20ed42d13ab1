//! `larder prefetch IMAGE [--platform os/arch]`: asks the admin listener
//! to warm the cache and shows its streamed progress: an `indicatif` bar
//! (bytes and blobs done of the totals, rate, ETA) when stdout is a
//! terminal, plain lines otherwise (at most one per
//! [`PLAIN_LINE_INTERVAL`], plus one per finished blob count change).

use std::io::Write as _;
use std::time::{Duration, Instant};

use http::Method;
use indicatif::ProgressBar;

use super::client::{AdminClient, CallError, Lines, refusal};
use crate::cache::prefetch::PrefetchProgress;
use crate::server::admin::operations::NDJSON;
use crate::server::admin::status_page::bytes;

/// Longest gap between two plain progress lines while bytes move.
pub const PLAIN_LINE_INTERVAL: Duration = Duration::from_secs(2);

/// How progress is shown.
enum Display {
    Bar(ProgressBar),
    Plain { last: Option<Instant>, last_blobs: usize },
}

impl Display {
    fn new(terminal: bool) -> Display {
        if !terminal {
            return Display::Plain { last: None, last_blobs: usize::MAX };
        }
        Display::Bar(super::progress::bar())
    }

    fn update(&mut self, p: &PrefetchProgress, started: Instant) {
        match self {
            Display::Bar(bar) => {
                bar.set_length(p.bytes_total.max(p.bytes_done));
                bar.set_position(p.bytes_done);
                bar.set_message(format!("{}/{} blobs", p.blobs_done, p.blobs_total));
            }
            Display::Plain { last, last_blobs } => {
                let due = last.is_none_or(|t| t.elapsed() >= PLAIN_LINE_INTERVAL);
                if !p.planned || (!due && p.blobs_done == *last_blobs) {
                    return;
                }
                *last = Some(Instant::now());
                *last_blobs = p.blobs_done;
                let secs = started.elapsed().as_secs_f64().max(0.001);
                println!(
                    "{} / {} ({}/{} blobs, {} fetched) {}/s",
                    bytes(p.bytes_done),
                    bytes(p.bytes_total),
                    p.blobs_done,
                    p.blobs_total,
                    p.fetched,
                    bytes((p.bytes_done as f64 / secs) as u64)
                );
                let _ = std::io::stdout().flush();
            }
        }
    }

    fn finish(&self) {
        if let Display::Bar(bar) = self {
            bar.finish_and_clear();
        }
    }
}

/// Runs the prefetch; prints progress and a closing summary line.
pub async fn run(
    client: &AdminClient,
    image: &str,
    platform: Option<&str>,
    referrers: bool,
    terminal: bool,
) -> Result<(), CallError> {
    let mut query = form_urlencoded::Serializer::new(String::new());
    query.append_pair("image", image);
    if let Some(platform) = platform {
        query.append_pair("platform", platform);
    }
    if referrers {
        query.append_pair("referrers", "true");
    }
    let started = Instant::now();
    let resp = client.call(Method::POST, &format!("/prefetch?{}", query.finish()), NDJSON).await?;
    println!(
        "prefetching {image}{} through {}",
        platform.map(|p| format!(" ({p})")).unwrap_or_default(),
        client.base()
    );
    let mut display = Display::new(terminal);
    let mut lines = Lines::new(resp.into_body());
    let outcome = loop {
        let Some(event) = lines.next().await? else {
            break Err(CallError::Protocol("the answer ended before the prefetch did".into()));
        };
        match event["event"].as_str() {
            Some("progress") => {
                if let Ok(p) = serde_json::from_value::<PrefetchProgress>(event) {
                    display.update(&p, started);
                }
            }
            Some("done") => break Ok(event),
            Some("error") => {
                let status = event["status"].as_u64().unwrap_or(0) as u16;
                break Err(refusal(status, event.to_string().as_bytes()));
            }
            _ => {}
        }
    };
    display.finish();
    let done = outcome?;
    let n = |k: &str| done[k].as_u64().unwrap_or(0);
    println!(
        "prefetched {image}: {} manifest{}, {} blobs ({} fetched from upstream), {} in {:.1} s",
        n("manifests"),
        if n("manifests") == 1 { "" } else { "s" },
        n("blobs"),
        n("fetched"),
        bytes(n("bytes")),
        started.elapsed().as_secs_f64()
    );
    if let Some(referrers) = done["referrers"].as_u64() {
        println!("  with {referrers} referrers (signatures, SBOMs, attestations) and their blobs");
    }
    Ok(())
}
