//! The errors switchyard answers with itself, each carrying its classification:
//! HTTP status, who failed, whether a client's retry could help, and the
//! OpenAI-format body.
//!
//! Upstream error bodies are never copied into these messages; only the
//! upstream status is named, so no key, URL or vendor text can leak.

use std::borrow::Cow;

use bytes::Bytes;
use http::StatusCode;

/// nginx's status for a client that closed its connection first.
const CLIENT_CLOSED_REQUEST: StatusCode = match StatusCode::from_u16(499) {
    Ok(status) => status,
    Err(_) => StatusCode::BAD_REQUEST,
};

/// Who caused an error, for logs and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Culprit {
    /// The client's request was unacceptable.
    Downstream,
    /// Every upstream failed, or the budget ran out waiting for them.
    Upstream,
    /// switchyard itself.
    Internal,
}

/// An error response made by switchyard (not relayed from an upstream).
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// The body is not a JSON object, or a field is missing or has the wrong
    /// type ([`crate::request::ChatRequest::parse`]). 400.
    #[error("invalid request: {message}")]
    BadRequest {
        /// What is wrong.
        message: String,
        /// The offending field (`stream`, `messages[2].role`), if one is to blame.
        param: Option<Cow<'static, str>>,
    },
    /// A request body in a media type other than JSON. 415.
    #[error("unsupported Content-Type `{0}`: send application/json")]
    UnsupportedMediaType(String),
    /// No task by that name, alias or `x-task-type`, and no default task. 404.
    #[error("unknown model or task `{0}`")]
    UnknownModel(String),
    /// No such endpoint. 404.
    #[error("no route for {0}")]
    NotFound(String),
    /// Wrong method for the endpoint (the methods it answers, for `Allow`). 405.
    #[error("method not allowed")]
    MethodNotAllowed(&'static str),
    /// The request body did not arrive whole within the time allowed. 408.
    #[error("the request body did not arrive within {} s", .0.as_secs())]
    BodyTimeout(std::time::Duration),
    /// The client closed the connection before its request body was whole:
    /// nobody hears the answer; 499 (nginx's) in the access log and metrics.
    #[error("the client closed the connection before its request body arrived")]
    ClientGone,
    /// Request body over the limit. 413.
    #[error("request body larger than {0} bytes")]
    PayloadTooLarge(usize),
    /// Every candidate failed. 502. `last_status` is the last upstream status, if any.
    #[error("all targets failed{}", last_status.map(|s| format!("; last upstream status {s}")).unwrap_or_default())]
    AllTargetsFailed {
        /// The last upstream HTTP status seen.
        last_status: Option<u16>,
    },
    /// Nothing could be tried: every target is DOWN (and `health.all_down`
    /// is `fail`, or its trial is taken), paused by a cooldown, or without a
    /// usable API key (every key revoked). 503, with
    /// `Retry-After` until the earliest one may be tried again.
    #[error("no target available: all are down, cooling down or without a usable API key")]
    NoTargetAvailable {
        /// Until the earliest target may be tried again, if known.
        retry_after: Option<std::time::Duration>,
    },
    /// No target of the task can take this request (a capability it lacks, a
    /// context window too small). 400; a prompt too long for every window is
    /// `context_length_exceeded` (param `messages`), as an upstream says it,
    /// so that agents trim on it.
    #[error("no target of this task can serve the request: {why}")]
    NoEligibleTarget {
        /// The rule that left the targets out, in words.
        why: String,
        /// It was the context window: the prompt is too long for every target.
        too_long: bool,
    },
    /// A rate limit stands in the way: the task's (or the caller's) bucket is
    /// empty, or every target that could serve is rate-limited upstream. 429,
    /// with `Retry-After`.
    #[error("rate limit exceeded; retry in {:.1} s", .0.as_secs_f64())]
    RateLimited(std::time::Duration),
    /// More chat requests in progress than `max_concurrent_requests`. 503, with `Retry-After`.
    #[error("too many requests in progress; retry shortly")]
    Overloaded,
    /// switchyard ran out of a local resource (file descriptors, local
    /// ports) before the request left: no upstream was called or blamed. 503,
    /// with `Retry-After`.
    #[error("switchyard is out of local resources ({0}); no upstream was called")]
    LocalResources(String),
    /// An admin endpoint without the configured token. 401.
    #[error("this endpoint needs the admin token")]
    Unauthorized,
    /// The answer broke the request's tool call contract, and the one retry on
    /// another candidate did not produce a valid one. 502.
    #[error("degraded answer broke the request's contract: {0}")]
    ContractViolation(String),
    /// `total_timeout` passed before an answer. 504.
    #[error("the task's total_timeout of {0:?} was exhausted")]
    DeadlineExceeded(std::time::Duration),
}

impl From<crate::request::RequestError> for GatewayError {
    fn from(e: crate::request::RequestError) -> Self {
        GatewayError::BadRequest {
            message: e.message,
            param: e.param,
        }
    }
}

impl GatewayError {
    /// HTTP status of the response.
    #[must_use]
    pub fn status(&self) -> StatusCode {
        match self {
            GatewayError::BadRequest { .. } | GatewayError::NoEligibleTarget { .. } => {
                StatusCode::BAD_REQUEST
            }
            GatewayError::RateLimited(_) => StatusCode::TOO_MANY_REQUESTS,
            GatewayError::UnknownModel(_) | GatewayError::NotFound(_) => StatusCode::NOT_FOUND,
            GatewayError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            GatewayError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            GatewayError::BodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            GatewayError::ClientGone => CLIENT_CLOSED_REQUEST,
            GatewayError::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            GatewayError::AllTargetsFailed { .. } | GatewayError::ContractViolation(_) => {
                StatusCode::BAD_GATEWAY
            }
            GatewayError::NoTargetAvailable { .. }
            | GatewayError::Overloaded
            | GatewayError::LocalResources(_) => StatusCode::SERVICE_UNAVAILABLE,
            GatewayError::Unauthorized => StatusCode::UNAUTHORIZED,
            GatewayError::DeadlineExceeded(_) => StatusCode::GATEWAY_TIMEOUT,
        }
    }

    /// Who failed.
    #[must_use]
    pub fn culprit(&self) -> Culprit {
        match self {
            GatewayError::BadRequest { .. }
            | GatewayError::NoEligibleTarget { .. }
            | GatewayError::RateLimited(_)
            | GatewayError::Unauthorized
            | GatewayError::UnknownModel(_)
            | GatewayError::NotFound(_)
            | GatewayError::MethodNotAllowed(_)
            | GatewayError::PayloadTooLarge(_)
            | GatewayError::BodyTimeout(_)
            | GatewayError::ClientGone
            | GatewayError::UnsupportedMediaType(_) => Culprit::Downstream,
            GatewayError::AllTargetsFailed { .. }
            | GatewayError::ContractViolation(_)
            | GatewayError::NoTargetAvailable { .. }
            | GatewayError::DeadlineExceeded(_) => Culprit::Upstream,
            GatewayError::Overloaded | GatewayError::LocalResources(_) => Culprit::Internal,
        }
    }

    /// Whether a client's own retry of the same request could help: false
    /// when switchyard already retried and failed over, or when the request
    /// itself is at fault. Such errors carry `x-should-retry: false`.
    #[must_use]
    pub fn retryable(&self) -> bool {
        match self {
            // A body that came too slowly may come in time on a retry.
            GatewayError::RateLimited(_)
            | GatewayError::Overloaded
            | GatewayError::LocalResources(_)
            | GatewayError::BodyTimeout(_) => true,
            // With a known time a target can be tried again (`Retry-After`),
            // a retry then can help; without one, it cannot. Never both headers.
            GatewayError::NoTargetAvailable { retry_after } => retry_after.is_some(),
            GatewayError::BadRequest { .. }
            | GatewayError::UnknownModel(_)
            | GatewayError::NotFound(_)
            | GatewayError::MethodNotAllowed(_)
            | GatewayError::PayloadTooLarge(_)
            | GatewayError::ClientGone
            | GatewayError::UnsupportedMediaType(_)
            | GatewayError::AllTargetsFailed { .. }
            | GatewayError::NoEligibleTarget { .. }
            | GatewayError::Unauthorized
            | GatewayError::ContractViolation(_)
            | GatewayError::DeadlineExceeded(_) => false,
        }
    }

    /// Whole seconds for `Retry-After` (at least 1), for errors that pass in time.
    #[must_use]
    pub fn retry_after(&self) -> Option<u64> {
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let whole = |wait: &std::time::Duration| wait.as_secs_f64().ceil().max(1.0) as u64;
        match self {
            GatewayError::RateLimited(wait) => Some(whole(wait)),
            GatewayError::NoTargetAvailable { retry_after } => retry_after.as_ref().map(whole),
            GatewayError::Overloaded | GatewayError::LocalResources(_) => Some(1),
            GatewayError::BadRequest { .. }
            | GatewayError::UnknownModel(_)
            | GatewayError::NotFound(_)
            | GatewayError::MethodNotAllowed(_)
            | GatewayError::PayloadTooLarge(_)
            | GatewayError::BodyTimeout(_)
            | GatewayError::ClientGone
            | GatewayError::UnsupportedMediaType(_)
            | GatewayError::AllTargetsFailed { .. }
            | GatewayError::NoEligibleTarget { .. }
            | GatewayError::Unauthorized
            | GatewayError::ContractViolation(_)
            | GatewayError::DeadlineExceeded(_) => None,
        }
    }

    /// OpenAI `error.type`: what went wrong, by who failed.
    #[must_use]
    pub fn error_type(&self) -> &'static str {
        match (self, self.culprit()) {
            (GatewayError::RateLimited(_), _) => "rate_limit_error",
            (GatewayError::ContractViolation(_), _) => "degraded_contract_violation",
            (_, Culprit::Downstream) => "invalid_request_error",
            (_, Culprit::Upstream) => "upstream_error",
            (_, Culprit::Internal) => "server_error",
        }
    }

    /// OpenAI `error.param`: the request field at fault, if one is.
    #[must_use]
    pub fn param(&self) -> Option<&str> {
        match self {
            GatewayError::BadRequest { param, .. } => param.as_deref(),
            GatewayError::NoEligibleTarget { too_long: true, .. } => Some("messages"),
            GatewayError::UnknownModel(_)
            | GatewayError::RateLimited(_)
            | GatewayError::NotFound(_)
            | GatewayError::MethodNotAllowed(_)
            | GatewayError::PayloadTooLarge(_)
            | GatewayError::BodyTimeout(_)
            | GatewayError::ClientGone
            | GatewayError::UnsupportedMediaType(_)
            | GatewayError::AllTargetsFailed { .. }
            | GatewayError::NoTargetAvailable { .. }
            | GatewayError::NoEligibleTarget { .. }
            | GatewayError::Overloaded
            | GatewayError::LocalResources(_)
            | GatewayError::Unauthorized
            | GatewayError::ContractViolation(_)
            | GatewayError::DeadlineExceeded(_) => None,
        }
    }

    /// OpenAI `error.code`; also the `reason` metric label.
    #[must_use]
    pub fn code(&self) -> &'static str {
        match self {
            GatewayError::BadRequest { .. } => "invalid_request",
            GatewayError::NoEligibleTarget { too_long: true, .. } => "context_length_exceeded",
            GatewayError::NoEligibleTarget { .. } => "no_eligible_target",
            GatewayError::RateLimited(_) => "rate_limit_exceeded",
            GatewayError::UnknownModel(_) => "model_not_found",
            GatewayError::NotFound(_) => "not_found",
            GatewayError::MethodNotAllowed(_) => "method_not_allowed",
            GatewayError::PayloadTooLarge(_) => "payload_too_large",
            GatewayError::BodyTimeout(_) => "request_timeout",
            GatewayError::ClientGone => "client_cancelled",
            GatewayError::UnsupportedMediaType(_) => "unsupported_media_type",
            GatewayError::AllTargetsFailed { .. } => "all_targets_failed",
            GatewayError::ContractViolation(_) => "degraded_contract_violation",
            GatewayError::NoTargetAvailable { .. } => "no_target_available",
            GatewayError::Overloaded => "overloaded",
            GatewayError::LocalResources(_) => "local_resources_exhausted",
            GatewayError::Unauthorized => "unauthorized",
            GatewayError::DeadlineExceeded(_) => "deadline_exceeded",
        }
    }

    /// The OpenAI-format body: `{"error": {"message", "type", "code", "param"}}`.
    #[must_use]
    pub fn body(&self) -> Bytes {
        error_body_with(
            &self.to_string(),
            self.error_type(),
            self.code(),
            self.param(),
        )
    }

    /// A 400 for a request that is not one the gateway can take.
    #[must_use]
    pub fn bad_request(message: impl Into<String>) -> Self {
        GatewayError::BadRequest {
            message: message.into(),
            param: None,
        }
    }
}

/// An OpenAI-format error body.
#[must_use]
pub fn error_body(message: &str, error_type: &str, code: &str) -> Bytes {
    error_body_with(message, error_type, code, None)
}

/// An OpenAI-format error body naming the offending field.
#[must_use]
pub fn error_body_with(message: &str, error_type: &str, code: &str, param: Option<&str>) -> Bytes {
    let v = serde_json::json!({
        "error": { "message": message, "type": error_type, "code": code, "param": param }
    });
    Bytes::from(v.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slow_body_is_a_retryable_408_and_a_client_gone_is_499() {
        let slow = GatewayError::BodyTimeout(std::time::Duration::from_secs(30));
        assert_eq!(slow.status(), StatusCode::REQUEST_TIMEOUT);
        assert_eq!(slow.code(), "request_timeout");
        assert!(slow.retryable());
        assert_eq!(slow.culprit(), Culprit::Downstream);
        assert_eq!(GatewayError::ClientGone.status().as_u16(), 499);
        assert_eq!(GatewayError::ClientGone.code(), "client_cancelled");
    }

    #[test]
    fn retry_after_and_should_retry_false_never_come_together() {
        let waits = GatewayError::NoTargetAvailable {
            retry_after: Some(std::time::Duration::from_secs(2)),
        };
        assert_eq!(waits.retry_after(), Some(2));
        assert!(waits.retryable(), "a known wait is worth retrying after");
        let never = GatewayError::NoTargetAvailable { retry_after: None };
        assert_eq!(never.retry_after(), None);
        assert!(!never.retryable());
    }

    #[test]
    fn readme_lists_every_error_code_with_its_status() {
        let readme = include_str!("../README.md");
        let readme = readme.split_whitespace().collect::<Vec<_>>().join(" ");
        let d = std::time::Duration::from_secs(1);
        // The match below fails to compile on a new variant: add it here too.
        let all = [
            GatewayError::BadRequest {
                message: String::new(),
                param: None,
            },
            GatewayError::UnsupportedMediaType(String::new()),
            GatewayError::UnknownModel(String::new()),
            GatewayError::NotFound(String::new()),
            GatewayError::MethodNotAllowed("POST"),
            GatewayError::BodyTimeout(d),
            GatewayError::ClientGone,
            GatewayError::PayloadTooLarge(1),
            GatewayError::AllTargetsFailed { last_status: None },
            GatewayError::NoTargetAvailable { retry_after: None },
            GatewayError::NoEligibleTarget {
                why: String::new(),
                too_long: false,
            },
            GatewayError::RateLimited(d),
            GatewayError::Overloaded,
            GatewayError::LocalResources(String::new()),
            GatewayError::Unauthorized,
            GatewayError::ContractViolation(String::new()),
            GatewayError::DeadlineExceeded(d),
        ];
        for e in &all {
            match e {
                GatewayError::BadRequest { .. }
                | GatewayError::UnsupportedMediaType(_)
                | GatewayError::UnknownModel(_)
                | GatewayError::NotFound(_)
                | GatewayError::MethodNotAllowed(_)
                | GatewayError::BodyTimeout(_)
                | GatewayError::ClientGone
                | GatewayError::PayloadTooLarge(_)
                | GatewayError::AllTargetsFailed { .. }
                | GatewayError::NoTargetAvailable { .. }
                | GatewayError::NoEligibleTarget { .. }
                | GatewayError::RateLimited(_)
                | GatewayError::Overloaded
                | GatewayError::LocalResources(_)
                | GatewayError::Unauthorized
                | GatewayError::ContractViolation(_)
                | GatewayError::DeadlineExceeded(_) => {}
            }
            let listed = format!("{} `{}`", e.status().as_u16(), e.code());
            assert!(readme.contains(&listed), "README does not list {listed}");
        }
    }
}
