//! An in-process Docker token server (the `auth.token` realm) for distribution.
//!
//! It signs ES256 JWTs with a fresh P-256 key whose self-signed certificate
//! distribution trusts through `rootcertbundle`; the JWT header's `kid` is the
//! libtrust key ID distribution looks the key up by.
//!
//! Policy: repositories under `private/` need the configured Basic
//! credentials for any action; every other repository is pullable
//! anonymously; valid credentials are granted every action they ask for
//! (pull, push, delete). Wrong credentials are answered 401.
//!
//! Tenants ([`TokenServer::add_user`]) are users whose access list the test
//! sets and changes: each may pull the repositories under its prefixes and
//! nothing else, and those prefixes become private (no anonymous pulls). A
//! tenant asking for a repository it may not pull gets a token with an
//! empty access list, as Docker Hub hands out; the registry then refuses
//! the request made with it.
//!
//! Every token request is recorded, so tests can assert on how many were
//! made and whether they carried credentials.
//!
//! The server runs on its own thread and runtime, so it keeps answering
//! whatever the test's runtime is doing (even blocking), and stops on drop.

use std::convert::Infallible;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::json;
use sha2::{Digest, Sha256};
use tokio::sync::oneshot;

/// How long an issued token is valid, in seconds (`expires_in`).
pub const TOKEN_LIFETIME_SECS: u64 = 300;

/// The prefix of repositories that anonymous requests get no access to.
pub const PRIVATE_PREFIX: &str = "private/";

/// A user name and password, for Basic auth to the token server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Credentials {
    pub user: String,
    pub password: String,
}

impl Credentials {
    pub fn new(user: &str, password: &str) -> Self {
        Credentials { user: user.to_owned(), password: password.to_owned() }
    }

    /// `user:password`, as skopeo's `--creds` flags take them.
    pub fn colon_joined(&self) -> String {
        format!("{}:{}", self.user, self.password)
    }
}

/// One request the token server answered.
#[derive(Clone, Debug)]
pub struct TokenRequest {
    pub method: String,
    /// The user name the request authenticated as (Basic header, or the
    /// OAuth2 password form), whether or not the password was right.
    pub user: Option<String>,
    /// True when the request carried an `Authorization: Basic` header.
    pub carried_basic: bool,
    /// True when the user name and password matched.
    pub credentials_valid: bool,
    pub service: Option<String>,
    /// The scopes asked for, e.g. `repository:team/app:pull`.
    pub scopes: Vec<String>,
    /// The access granted, in scope form, e.g. `repository:team/app:pull`.
    pub granted: Vec<String>,
    pub status: u16,
}

impl TokenRequest {
    /// True when the request asked for any scope on `repository`.
    pub fn asks_for(&self, repository: &str) -> bool {
        self.scopes.iter().any(|scope| parse_scope(scope).is_some_and(|(_, name, _)| name == repository))
    }
}

/// A running token server; see the module docs for its policy.
pub struct TokenServer {
    addr: SocketAddr,
    state: Arc<State>,
    cert_pem: String,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

struct State {
    key: EncodingKey,
    kid: String,
    service: String,
    issuer: String,
    credentials: Credentials,
    /// Tenants: password and the repository prefixes each may pull.
    tenants: Mutex<std::collections::HashMap<String, (String, Vec<String>)>>,
    /// Prefixes that anonymous requests get no access to, beyond `private/`.
    private: Mutex<Vec<String>>,
    requests: Mutex<Vec<TokenRequest>>,
    next_jti: AtomicU64,
}

impl State {
    fn requests(&self) -> MutexGuard<'_, Vec<TokenRequest>> {
        // A panic while holding this lock cannot leave the Vec half-updated.
        self.requests.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn mint(&self, subject: &str, access: &[(String, Vec<String>)]) -> String {
        let now = unix_now();
        let access: Vec<_> = access
            .iter()
            .map(|(name, actions)| json!({"type": "repository", "name": name, "actions": actions}))
            .collect();
        let claims = json!({
            "iss": self.issuer,
            "sub": subject,
            "aud": self.service,
            "exp": now + TOKEN_LIFETIME_SECS,
            "nbf": now - 10,
            "iat": now,
            "jti": format!("larder-test-{}", self.next_jti.fetch_add(1, Ordering::Relaxed)),
            "access": access,
        });
        let mut header = Header::new(Algorithm::ES256);
        header.kid = Some(self.kid.clone());
        jsonwebtoken::encode(&header, &claims, &self.key)
            .unwrap_or_else(|e| panic!("token server cannot sign a JWT: {e}"))
    }
}

impl TokenServer {
    /// Starts a token server on 127.0.0.1 for distribution's `service` and
    /// `issuer`, accepting `credentials` as the one valid user.
    pub fn start(service: &str, issuer: &str, credentials: Credentials) -> Self {
        let key_pair =
            rcgen::KeyPair::generate().unwrap_or_else(|e| panic!("cannot generate the token signing key: {e}"));
        let cert_pem = rcgen::CertificateParams::new(vec!["larder-test-token-issuer".to_owned()])
            .and_then(|params| params.self_signed(&key_pair))
            .unwrap_or_else(|e| panic!("cannot self-sign the token certificate: {e}"))
            .pem();
        let key = EncodingKey::from_ec_pem(key_pair.serialize_pem().as_bytes())
            .unwrap_or_else(|e| panic!("jsonwebtoken rejects the rcgen P-256 key: {e}"));
        let state = Arc::new(State {
            key,
            kid: libtrust_key_id(&key_pair.public_key_der()),
            service: service.to_owned(),
            issuer: issuer.to_owned(),
            credentials,
            tenants: Mutex::default(),
            private: Mutex::default(),
            requests: Mutex::new(Vec::new()),
            next_jti: AtomicU64::new(1),
        });

        let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .unwrap_or_else(|e| panic!("token server cannot bind 127.0.0.1:0: {e}"));
        let addr = listener.local_addr().unwrap_or_else(|e| panic!("token server cannot read its address: {e}"));
        listener
            .set_nonblocking(true)
            .unwrap_or_else(|e| panic!("token server cannot make its socket nonblocking: {e}"));
        let (shutdown, shutdown_rx) = oneshot::channel();
        let thread_state = Arc::clone(&state);
        let thread = std::thread::Builder::new()
            .name("token-server".to_owned())
            .spawn(move || serve(listener, thread_state, shutdown_rx))
            .unwrap_or_else(|e| panic!("cannot start the token server thread: {e}"));

        TokenServer { addr, state, cert_pem, shutdown: Some(shutdown), thread: Some(thread) }
    }

    /// The `realm` URL distribution sends clients to.
    pub fn realm(&self) -> String {
        format!("http://{}/token", self.addr)
    }

    pub fn service(&self) -> &str {
        &self.state.service
    }

    pub fn issuer(&self) -> &str {
        &self.state.issuer
    }

    /// The PEM certificate for distribution's `rootcertbundle`.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The libtrust key ID in every token's `kid` header.
    pub fn key_id(&self) -> &str {
        &self.state.kid
    }

    /// A token for `access` (repository name, actions), made without a request
    /// and so not recorded: for the harness's own reads of the origin.
    pub fn mint(&self, access: &[(&str, &[&str])]) -> String {
        let access: Vec<(String, Vec<String>)> = access
            .iter()
            .map(|(name, actions)| {
                let actions = actions.iter().map(|a| (*a).to_owned()).collect();
                ((*name).to_owned(), actions)
            })
            .collect();
        self.state.mint("larder-test-harness", &access)
    }

    /// Adds a tenant who may pull the repositories under `pulls` (e.g.
    /// `"team-a/"`), which become private.
    pub fn add_user(&self, credentials: &Credentials, pulls: &[&str]) {
        let pulls: Vec<String> = pulls.iter().map(|p| (*p).to_owned()).collect();
        lock(&self.state.private).extend(pulls.iter().cloned());
        lock(&self.state.tenants).insert(credentials.user.clone(), (credentials.password.clone(), pulls));
    }

    /// Changes what tenant `user` may pull (`&[]`: revoked).
    pub fn set_pulls(&self, user: &str, pulls: &[&str]) {
        let pulls: Vec<String> = pulls.iter().map(|p| (*p).to_owned()).collect();
        lock(&self.state.private).extend(pulls.iter().cloned());
        if let Some(tenant) = lock(&self.state.tenants).get_mut(user) {
            tenant.1 = pulls;
        }
    }

    /// Every request answered so far.
    pub fn requests(&self) -> Vec<TokenRequest> {
        self.state.requests().clone()
    }

    /// A position to count requests from, with [`TokenServer::requests_since`].
    pub fn mark(&self) -> usize {
        self.state.requests().len()
    }

    /// The requests answered after `mark`.
    pub fn requests_since(&self, mark: usize) -> Vec<TokenRequest> {
        self.state.requests().get(mark..).unwrap_or_default().to_vec()
    }
}

impl Drop for TokenServer {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// distribution's (libtrust's) key ID: SHA-256 of the DER
/// SubjectPublicKeyInfo, first 30 bytes, base32 without padding, in 12 groups
/// of 4 characters joined by `:`.
pub fn libtrust_key_id(spki_der: &[u8]) -> String {
    let hash = Sha256::digest(spki_der);
    let encoded = data_encoding::BASE32_NOPAD.encode(&hash[..30]);
    let groups: Vec<&str> = (0..encoded.len()).step_by(4).map(|i| &encoded[i..(i + 4).min(encoded.len())]).collect();
    groups.join(":")
}

fn serve(listener: std::net::TcpListener, state: Arc<State>, mut shutdown: oneshot::Receiver<()>) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("token server cannot build its runtime: {e}"));
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)
            .unwrap_or_else(|e| panic!("token server cannot register its socket: {e}"));
        loop {
            let stream = tokio::select! {
                _ = &mut shutdown => break,
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => stream,
                    Err(_) => continue,
                },
            };
            let state = Arc::clone(&state);
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |request| {
                    let state = Arc::clone(&state);
                    async move { Ok::<_, Infallible>(handle(&state, request).await) }
                });
                // A client hanging up mid-request is its own business.
                let _ =
                    hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service).await;
            });
        }
    });
}

async fn handle(state: &State, request: Request<Incoming>) -> Response<Full<Bytes>> {
    let method = request.method().as_str().to_owned();
    if request.uri().path() != "/token" {
        return json_response(StatusCode::NOT_FOUND, json!({"errors": [{"code": "NOT_FOUND"}]}));
    }
    let basic =
        request.headers().get(hyper::header::AUTHORIZATION).and_then(|value| value.to_str().ok()).and_then(parse_basic);
    let carried_basic = basic.is_some();
    let query = request.uri().query().unwrap_or("").to_owned();
    let mut params: Vec<(String, String)> = form_urlencoded::parse(query.as_bytes()).into_owned().collect();
    let mut user_pass = basic;
    if method == "POST" {
        // OAuth2 form (distribution token spec): grant_type=password carries
        // username/password in the body; scopes are space-separated.
        let body = request.into_body().collect().await.map(|collected| collected.to_bytes()).unwrap_or_default();
        let form: Vec<(String, String)> = form_urlencoded::parse(&body).into_owned().collect();
        let field = |key: &str| form.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone());
        if user_pass.is_none() && field("grant_type").as_deref() == Some("password") {
            user_pass = field("username").zip(field("password"));
        }
        params.extend(form);
    }
    let service = params.iter().find(|(k, _)| k == "service").map(|(_, v)| v.clone());
    let scopes: Vec<String> = params
        .iter()
        .filter(|(k, _)| k == "scope")
        .flat_map(|(_, v)| v.split_whitespace().map(str::to_owned).collect::<Vec<_>>())
        .collect();
    let credentials_valid = user_pass
        .as_ref()
        .is_some_and(|(user, password)| *user == state.credentials.user && *password == state.credentials.password);
    // A tenant's prefixes, when the request carries a tenant's right password.
    let tenant: Option<Vec<String>> = user_pass.as_ref().and_then(|(user, password)| {
        lock(&state.tenants).get(user).filter(|(p, _)| p == password).map(|(_, pulls)| pulls.clone())
    });
    let private: Vec<String> = lock(&state.private).clone();
    let is_private =
        |name: &str| name.starts_with(PRIVATE_PREFIX) || private.iter().any(|p| name.starts_with(p.as_str()));
    let mut record = TokenRequest {
        method,
        user: user_pass.as_ref().map(|(user, _)| user.clone()),
        carried_basic,
        credentials_valid,
        service,
        scopes: scopes.clone(),
        granted: Vec::new(),
        status: 200,
    };

    if user_pass.is_some() && !credentials_valid && tenant.is_none() {
        record.status = 401;
        state.requests().push(record);
        return json_response(
            StatusCode::UNAUTHORIZED,
            json!({"errors": [{"code": "UNAUTHORIZED", "message": "wrong user name or password"}]}),
        );
    }

    let access: Vec<(String, Vec<String>)> = scopes
        .iter()
        .filter_map(|scope| parse_scope(scope))
        .filter(|(kind, _, _)| *kind == "repository")
        .filter_map(|(_, name, actions)| {
            let allowed: Vec<String> = actions
                .split(',')
                .filter(|action| match &tenant {
                    Some(pulls) => *action == "pull" && pulls.iter().any(|p| name.starts_with(p.as_str())),
                    None => credentials_valid || (*action == "pull" && !is_private(name)),
                })
                .map(str::to_owned)
                .collect();
            (!allowed.is_empty()).then(|| (name.to_owned(), allowed))
        })
        .collect();
    record.granted = access.iter().map(|(name, actions)| format!("repository:{name}:{}", actions.join(","))).collect();
    record.credentials_valid = credentials_valid || tenant.is_some();
    let subject = record.user.clone().filter(|_| record.credentials_valid).unwrap_or_default();
    let token = state.mint(&subject, &access);
    state.requests().push(record);
    json_response(StatusCode::OK, json!({"token": token, "access_token": token, "expires_in": TOKEN_LIFETIME_SECS}))
}

/// `type:name:actions`; the name may not hold `:`, but the type may carry a
/// `(class)` suffix, so split on the first and the last colon.
fn parse_scope(scope: &str) -> Option<(&str, &str, &str)> {
    let (kind, rest) = scope.split_once(':')?;
    let (name, actions) = rest.rsplit_once(':')?;
    let kind = kind.split('(').next().unwrap_or(kind);
    Some((kind, name, actions))
}

fn parse_basic(header: &str) -> Option<(String, String)> {
    let (scheme, encoded) = header.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = data_encoding::BASE64.decode(encoded.trim().as_bytes()).ok()?;
    let decoded = String::from_utf8(decoded).ok()?;
    let (user, password) = decoded.split_once(':')?;
    Some((user.to_owned(), password.to_owned()))
}

fn json_response(status: StatusCode, body: serde_json::Value) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("application/json"));
    response
}

/// A lock whose data a panic elsewhere cannot have left half-changed.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| elapsed.as_secs())
        .unwrap_or_else(|e| panic!("the clock is before 1970: {e}"))
}
