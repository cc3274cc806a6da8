//! A provider's proof of identity beyond a static key: a token that expires
//! (Vertex AI's OAuth2 access token) or a signature over each request (AWS
//! SigV4 for Bedrock). Both come from their clouds' own libraries
//! (`google-cloud-auth`, `aws-config` + `aws-sigv4`), which find the
//! credentials the way a pod has them; switchyard only caches what they give
//! and refreshes it before it expires. A static API key stays a
//! [`super::Credential`] of the provider's key pool.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use aws_credential_types::provider::ProvideCredentials;
use aws_credential_types::Credentials as AwsCredentials;
use bytes::Bytes;
use http::header::{HeaderValue, AUTHORIZATION};
use http::Request;
use http_body_util::Full;
use tracing::debug;

/// How long before a credential's expiry a fresh one is fetched.
const REFRESH_AHEAD: Duration = Duration::from_secs(300);

/// Why a call has no credentials (never with any part of a secret).
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct AuthError(pub String);

/// Where a provider's identity comes from.
#[derive(Debug)]
pub enum Auth {
    /// A Google OAuth2 access token (Vertex AI).
    Google(GoogleToken),
    /// AWS SigV4 over each request (Bedrock without an API key).
    SigV4(SigV4),
}

/// What one request carries: a bearer token, or credentials to sign it with.
#[derive(Clone)]
pub enum Ready {
    /// `authorization: Bearer {token}`, marked sensitive.
    Bearer(HeaderValue),
    /// Sign with these credentials.
    Sign(Arc<AwsCredentials>),
}

impl std::fmt::Debug for Ready {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Ready::Bearer(_) => f.write_str("Bearer(*****)"),
            Ready::Sign(_) => f.write_str("Sign(*****)"),
        }
    }
}

impl Auth {
    /// The credentials of one request, cached or fetched now.
    ///
    /// # Errors
    /// The source has none to give (no credentials found, the token endpoint
    /// or the metadata server failed).
    pub async fn ready(&self) -> Result<Ready, AuthError> {
        match self {
            Auth::Google(google) => google.ready().await,
            Auth::SigV4(signer) => signer.ready().await.map(Ready::Sign),
        }
    }

    /// The upstream refused what `ready` gave (a 401): the cached token or
    /// credentials are let go, so the next request fetches them anew rather
    /// than sending the refused ones until they would have expired.
    pub fn refused(&self) {
        match self {
            Auth::Google(google) => google.state.lock().value = None,
            Auth::SigV4(signer) => {
                if let Ok(mut current) = signer.current.try_lock() {
                    current.value = None;
                }
            }
        }
    }

    /// Puts `ready` on a built request: its header, or its signature (over
    /// the method, the URL, every header set so far and the body).
    pub fn apply(&self, ready: &Ready, request: &mut Request<Full<Bytes>>, body: &[u8]) {
        match (self, ready) {
            (_, Ready::Bearer(value)) => {
                request.headers_mut().insert(AUTHORIZATION, value.clone());
            }
            (Auth::SigV4(signer), Ready::Sign(credentials)) => {
                if let Err(e) = signer.sign(credentials, request, body) {
                    // Sent unsigned, the upstream refuses it as a 403.
                    debug!(error = %e, "SigV4 signing failed");
                }
            }
            (Auth::Google(_), Ready::Sign(_)) => {}
        }
    }
}

/// An OAuth2 access token for Google Cloud, from a service-account file or
/// Application Default Credentials (`GOOGLE_APPLICATION_CREDENTIALS`, else
/// the metadata server: GKE Workload Identity). The library is set up on
/// first use (it starts its refresh task on the runtime it is made on, and
/// `validate` makes no runtime); it caches the token and refreshes it before
/// it expires. A fetch that fails or hangs drops it (and its refresh task):
/// for [`RETRY_AFTER_FAILURE`] calls fail at once, then it is made anew, so
/// one bad answer or one stuck connection of the token source never outlives
/// the source's own trouble.
pub struct GoogleToken {
    file: Option<serde_json::Value>,
    state: Arc<parking_lot::Mutex<Source<google_cloud_auth::credentials::AccessTokenCredentials>>>,
}

impl std::fmt::Debug for GoogleToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GoogleToken(*****)")
    }
}

/// The scope every Vertex AI call needs.
const CLOUD_PLATFORM: &str = "https://www.googleapis.com/auth/cloud-platform";

impl GoogleToken {
    /// From a service-account key file's JSON, or `None`: Application
    /// Default Credentials.
    ///
    /// # Errors
    /// The JSON is not a service-account key the library can use.
    pub fn new(file: Option<serde_json::Value>) -> Result<Self, AuthError> {
        if let Some(json) = &file {
            service_account_key(json)?;
        }
        Ok(Self {
            file,
            state: Arc::new(parking_lot::Mutex::new(Source::default())),
        })
    }

    fn build(&self) -> Result<google_cloud_auth::credentials::AccessTokenCredentials, AuthError> {
        use google_cloud_auth::credentials::{self, service_account};
        let built = match &self.file {
            Some(json) => service_account::Builder::new(json.clone())
                .with_access_specifier(service_account::AccessSpecifier::from_scopes([
                    CLOUD_PLATFORM,
                ]))
                .build_access_token_credentials(),
            None => credentials::Builder::default()
                .with_scopes([CLOUD_PLATFORM])
                .build_access_token_credentials(),
        };
        built.map_err(|e| AuthError(format!("Google credentials: {e}")))
    }

    async fn ready(&self) -> Result<Ready, AuthError> {
        let credentials = {
            let mut state = self.state.lock();
            state.recent_failure()?;
            match &state.value {
                Some(credentials) => Arc::clone(credentials),
                None => {
                    let made = Arc::new(self.build()?);
                    state.value = Some(Arc::clone(&made));
                    made
                }
            }
        };
        // The fetch runs as a task of its own, bounded by its own timeout:
        // a request cut short by its deadline still leaves a stuck fetch
        // judged (and its source dropped), so the next ones recover.
        let state = Arc::clone(&self.state);
        let fetch = tokio::spawn(async move {
            let why = match tokio::time::timeout(FETCH_TIMEOUT, credentials.access_token()).await {
                Ok(Ok(token)) => return Ok(token),
                Ok(Err(e)) => format!("no Google access token (its source is made anew): {e}"),
                Err(_) => format!("no Google access token in {} s", FETCH_TIMEOUT.as_secs()),
            };
            Err(state.lock().failed(why))
        });
        let token = fetch
            .await
            .map_err(|_| AuthError("the Google token fetch ended without an answer".into()))??;
        let mut value = HeaderValue::from_str(&format!("Bearer {}", token.token))
            .map_err(|_| AuthError("the Google access token is not a header value".into()))?;
        value.set_sensitive(true);
        Ok(Ready::Bearer(value))
    }
}

/// What Google's library needs of a service-account key (its PEM parsed, as
/// it will be), checked when the file is read; never the key in a message.
fn service_account_key(json: &serde_json::Value) -> Result<(), AuthError> {
    use rustls::pki_types::{pem::PemObject, PrivateKeyDer};
    let text = |key: &str| json.get(key).and_then(serde_json::Value::as_str);
    if text("type") != Some("service_account") {
        return Err(AuthError(
            "a service-account key (\"type\": \"service_account\") is expected; for other \
             kinds of credentials leave credentials_file unset and set GOOGLE_APPLICATION_CREDENTIALS"
                .into(),
        ));
    }
    let fields = [
        "client_email",
        "private_key",
        "private_key_id",
        "project_id",
    ];
    if let Some(missing) = fields.into_iter().find(|key| text(key).is_none()) {
        return Err(AuthError(format!(
            "the service-account key has no `{missing}`"
        )));
    }
    let pem = text("private_key").unwrap_or_default();
    let usable = PrivateKeyDer::from_pem_slice(pem.as_bytes())
        .ok()
        .is_some_and(|key| rustls::crypto::ring::sign::any_supported_type(&key).is_ok());
    if usable {
        Ok(())
    } else {
        Err(AuthError(
            "the service-account key's `private_key` is not a PEM private key it can sign with"
                .into(),
        ))
    }
}

/// How long one fetch of a token or of credentials may take.
const FETCH_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a failed fetch is the answer for every call (then tried again).
pub const RETRY_AFTER_FAILURE: Duration = Duration::from_secs(2);

/// A credential source's last good value, and its last failure.
struct Source<T> {
    value: Option<Arc<T>>,
    failure: Option<(tokio::time::Instant, AuthError)>,
}

impl<T> Default for Source<T> {
    fn default() -> Self {
        Self {
            value: None,
            failure: None,
        }
    }
}

impl<T> Source<T> {
    /// The last failure, while it is recent: the answer without a new fetch.
    fn recent_failure(&self) -> Result<(), AuthError> {
        match &self.failure {
            Some((at, e)) if at.elapsed() < RETRY_AFTER_FAILURE => Err(e.clone()),
            Some(_) | None => Ok(()),
        }
    }

    /// Forgets the value (made anew after a while) and remembers why.
    fn failed(&mut self, why: String) -> AuthError {
        let e = AuthError(why);
        self.value = None;
        self.failure = Some((tokio::time::Instant::now(), e.clone()));
        e
    }
}

/// AWS SigV4 with the standard credential chain (environment, shared files
/// and a profile, web identity, container credentials, instance metadata),
/// built on first use; credentials are kept until five minutes before they
/// expire, one refresh at a time.
pub struct SigV4 {
    region: String,
    service: &'static str,
    profile: Option<String>,
    chain:
        tokio::sync::OnceCell<aws_config::default_provider::credentials::DefaultCredentialsChain>,
    /// Held across a fetch: one at a time, and those waiting take its result.
    current: tokio::sync::Mutex<Source<AwsCredentials>>,
}

impl std::fmt::Debug for SigV4 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigV4")
            .field("region", &self.region)
            .field("service", &self.service)
            .field("profile", &self.profile)
            .finish_non_exhaustive()
    }
}

impl SigV4 {
    /// Signs for `service` in `region`, with credentials of `profile` when
    /// given (else the chain's own choice, `AWS_PROFILE` or `default`).
    #[must_use]
    pub fn new(region: &str, service: &'static str, profile: Option<&str>) -> Self {
        Self {
            region: region.to_owned(),
            service,
            profile: profile.map(str::to_owned),
            chain: tokio::sync::OnceCell::new(),
            current: tokio::sync::Mutex::new(Source::default()),
        }
    }

    async fn ready(&self) -> Result<Arc<AwsCredentials>, AuthError> {
        let mut current = self.current.lock().await;
        if let Some(credentials) = current.value.as_ref().filter(|c| fresh(c)) {
            return Ok(Arc::clone(credentials));
        }
        current.recent_failure()?;
        let chain = self.chain.get_or_init(|| self.build_chain()).await;
        match tokio::time::timeout(FETCH_TIMEOUT, chain.provide_credentials()).await {
            Ok(Ok(fetched)) => {
                let fetched = Arc::new(fetched);
                current.value = Some(Arc::clone(&fetched));
                current.failure = None;
                Ok(fetched)
            }
            Ok(Err(e)) => {
                let why = aws_smithy_types::error::display::DisplayErrorContext(&e);
                Err(current.failed(format!("no AWS credentials: {why}")))
            }
            Err(_) => Err(current.failed(format!(
                "no AWS credentials in {} s",
                FETCH_TIMEOUT.as_secs()
            ))),
        }
    }

    async fn build_chain(
        &self,
    ) -> aws_config::default_provider::credentials::DefaultCredentialsChain {
        use aws_smithy_http_client::tls::{rustls_provider::CryptoMode, Provider};
        let client = aws_smithy_http_client::Builder::new()
            .tls_provider(Provider::Rustls(CryptoMode::Ring))
            .build_https();
        let region = aws_config::Region::new(self.region.clone());
        let config = aws_config::provider_config::ProviderConfig::default()
            .with_http_client(client)
            .with_region(Some(region.clone()));
        let mut builder =
            aws_config::default_provider::credentials::DefaultCredentialsChain::builder()
                .configure(config)
                .region(region);
        if let Some(profile) = &self.profile {
            builder = builder.profile_name(profile);
        }
        builder.build().await
    }

    fn sign(
        &self,
        credentials: &AwsCredentials,
        request: &mut Request<Full<Bytes>>,
        body: &[u8],
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        use aws_sigv4::http_request::{sign, SignableBody, SignableRequest, SigningSettings};
        use aws_sigv4::sign::v4;
        let identity = credentials.clone().into();
        let params = v4::SigningParams::builder()
            .identity(&identity)
            .region(&self.region)
            .name(self.service)
            .time(SystemTime::now())
            .settings(SigningSettings::default())
            .build()?
            .into();
        let uri = request.uri().to_string();
        let headers = request
            .headers()
            .iter()
            .filter_map(|(name, value)| Some((name.as_str(), value.to_str().ok()?)));
        let signable = SignableRequest::new(
            request.method().as_str(),
            uri,
            headers,
            SignableBody::Bytes(body),
        )?;
        let (instructions, _signature) = sign(signable, &params)?.into_parts();
        instructions.apply_to_request_http1x(request);
        for name in [AUTHORIZATION.as_str(), "x-amz-security-token"] {
            if let Some(value) = request.headers_mut().get_mut(name) {
                value.set_sensitive(true);
            }
        }
        Ok(())
    }
}

/// Whether credentials can still sign for a while (long-term ones always).
fn fresh(credentials: &AwsCredentials) -> bool {
    credentials
        .expiry()
        .is_none_or(|at| at > SystemTime::now() + REFRESH_AHEAD)
}
