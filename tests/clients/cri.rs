//! CRI's `ImageService.PullImage` over containerd's socket, as a kubelet
//! calls it: gRPC over HTTP/2 on a Unix socket, with the request encoded
//! by hand (no protobuf crate for three messages):
//!
//! ```text
//! PullImageRequest { ImageSpec image = 1; AuthConfig auth = 2; }
//! ImageSpec        { string image = 1; }
//! AuthConfig       { string username = 1; string password = 2; string auth = 3;
//!                    string server_address = 4; string identity_token = 5; }
//! PullImageResponse{ string image_ref = 1; }
//! ```

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};

/// How long a pull may take before the test gives up on it.
const PULL_TIMEOUT: Duration = Duration::from_secs(120);

/// The `AuthConfig` of a pull: what a kubelet fills from a pod's pull
/// secret (its `keyring` sets the user name and password, and no
/// `server_address`; see docs/access.md).
#[derive(Clone, Debug, Default)]
pub struct AuthConfig {
    pub username: String,
    pub password: String,
    pub server_address: String,
}

impl AuthConfig {
    pub fn basic(username: &str, password: &str) -> AuthConfig {
        AuthConfig { username: username.to_owned(), password: password.to_owned(), ..Default::default() }
    }
}

/// A length-delimited protobuf field.
fn field(number: u8, payload: &[u8]) -> Vec<u8> {
    let mut out = vec![(number << 3) | 2];
    let mut n = payload.len();
    loop {
        let low = (n & 0x7f) as u8;
        n >>= 7;
        if n == 0 {
            out.push(low);
            break;
        }
        out.push(low | 0x80);
    }
    out.extend_from_slice(payload);
    out
}

fn pull_request(image: &str, auth: Option<&AuthConfig>) -> Vec<u8> {
    let mut message = field(1, &field(1, image.as_bytes()));
    if let Some(a) = auth {
        let mut config = Vec::new();
        for (number, value) in [(1, &a.username), (2, &a.password), (4, &a.server_address)] {
            if !value.is_empty() {
                config.extend(field(number, value.as_bytes()));
            }
        }
        message.extend(field(2, &config));
    }
    message
}

/// `PullImage(image, auth)`: the image's reference (`image_ref`) or the
/// gRPC error containerd answered.
pub async fn pull_image(socket: &Path, image: &str, auth: Option<&AuthConfig>) -> Result<String, String> {
    tokio::time::timeout(PULL_TIMEOUT, call(socket, image, auth))
        .await
        .unwrap_or_else(|_| Err(format!("PullImage {image} did not finish in {PULL_TIMEOUT:?}")))
}

async fn call(socket: &Path, image: &str, auth: Option<&AuthConfig>) -> Result<String, String> {
    let stream = tokio::net::UnixStream::connect(socket).await.map_err(|e| format!("{}: {e}", socket.display()))?;
    let (mut sender, connection) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
        .await
        .map_err(|e| format!("HTTP/2 to containerd: {e}"))?;
    tokio::spawn(connection);
    let message = pull_request(image, auth);
    let mut framed = vec![0u8];
    framed.extend_from_slice(&(message.len() as u32).to_be_bytes());
    framed.extend_from_slice(&message);
    let request = http::Request::post("http://localhost/runtime.v1.ImageService/PullImage")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(Full::new(Bytes::from(framed)))
        .map_err(|e| e.to_string())?;
    let response = sender.send_request(request).await.map_err(|e| format!("PullImage: {e}"))?;
    let (parts, body) = response.into_parts();
    let collected = body.collect().await.map_err(|e| format!("PullImage response: {e}"))?;
    let trailers = collected.trailers().cloned().unwrap_or_default();
    let bytes = collected.to_bytes();
    // A trailers-only answer carries its status in the headers.
    let header = |name: &str| {
        trailers.get(name).or_else(|| parts.headers.get(name)).map(|v| v.to_str().unwrap_or_default().to_owned())
    };
    match header("grpc-status").as_deref() {
        Some("0") => {}
        status => return Err(format!("grpc-status {status:?}: {}", header("grpc-message").unwrap_or_default())),
    }
    // One frame: flag, length, PullImageResponse { image_ref = 1 }.
    let message = bytes.get(5..).ok_or("a short PullImage response")?;
    let image_ref = message.get(2..).ok_or("an empty PullImageResponse")?;
    Ok(String::from_utf8_lossy(image_ref).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_is_encoded_as_protobuf_does() {
        // ImageSpec{image:"a"}, AuthConfig{username:"u", password:"p"}
        assert_eq!(
            pull_request("a", Some(&AuthConfig::basic("u", "p"))),
            b"\x0a\x03\x0a\x01a\x12\x06\x0a\x01u\x12\x01p"
        );
        assert_eq!(field(1, &[0; 200])[..3], [0x0a, 0xc8, 0x01], "a two-byte varint length");
    }
}
