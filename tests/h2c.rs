//! The registry listener speaks cleartext HTTP/2 (prior knowledge) on the
//! same port as HTTP/1.1: a blob is served whole and by range over h2c.

mod common;

use common::{ImageBuilder, KIB, Larder, Origin, origin::sha256_digest};

#[tokio::test(flavor = "multi_thread")]
async fn blobs_are_served_over_h2c() {
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().layers(&[300 * KIB]).push(&origin, "team/h2", "v1").await;
    let layer = image.manifests[0].layers[0].clone();
    let larder = Larder::builder().upstream(&origin).start().await;
    let client = reqwest::Client::builder().http2_prior_knowledge().build().expect("h2c client");

    let url = format!("{}/v2/team/h2/blobs/{}", larder.url(), layer.digest);
    let whole = client.get(&url).send().await.expect("h2c response");
    assert_eq!(whole.version(), reqwest::Version::HTTP_2);
    assert_eq!(whole.status(), 200);
    let bytes = whole.bytes().await.expect("body");
    assert_eq!(sha256_digest(&bytes), layer.digest);

    let part = client.get(&url).header("Range", "bytes=100-199").send().await.expect("ranged h2c response");
    assert_eq!((part.version(), part.status().as_u16()), (reqwest::Version::HTTP_2, 206));
    assert_eq!(part.headers()["content-range"], format!("bytes 100-199/{}", layer.size));
    assert_eq!(part.bytes().await.expect("range body"), bytes.slice(100..200));
}
