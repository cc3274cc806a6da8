//! A task's cache at both ends of the walk: a fresh answer served before any
//! target is asked (past the front door's limits, spending no provider's
//! bucket), the walk's answer kept ([`cache::Fill`], handed to the walk),
//! and a stale answer served when the walk ends without one.

use std::sync::Arc;

use bytes::BytesMut;
use http::header::HeaderValue;
use http::{Response, StatusCode};
use tracing::warn;

use super::respond;
use crate::body::{self, Body};
use crate::cache::{self, Ask, Hit, TaskCache};
use crate::native::{self, Protocol, StreamRender};
use crate::routing::Payload;
use crate::snapshot::Task;
use crate::telemetry::RequestTrace;

/// One request's side of its task's cache.
pub(super) struct Cached {
    cache: Arc<TaskCache>,
    ask: Ask,
    /// The request's prompt estimate (the usage of an answer that reports none).
    prompt_tokens: u64,
}

/// How a cached answer goes back.
pub(super) struct Reply<'a> {
    /// The client asked for a stream.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    pub request_id: &'a HeaderValue,
    pub trace: &'a RequestTrace,
}

impl Cached {
    /// The cache's reading of a chat request of `task`, if the task keeps a
    /// cache: keyed by the client's own body (its protocol's).
    pub(super) fn of(
        task: &Task,
        body: &[u8],
        headers: &http::HeaderMap,
        payload: &Payload<'_>,
        prompt_tokens: u64,
    ) -> Option<Self> {
        let cache = task.cache.as_ref()?;
        let Payload::Chat(request) = payload else {
            return None;
        };
        let (protocol, body) = request
            .native
            .map_or((Protocol::Chat, body), |n| (n.protocol, n.body));
        Some(Self {
            cache: Arc::clone(cache),
            ask: cache.ask(protocol, body, headers),
            prompt_tokens,
        })
    }

    /// Where the walk's answer is kept, if it may be.
    pub(super) fn fill(&self) -> Option<cache::Fill> {
        self.cache.fill(&self.ask, self.prompt_tokens)
    }

    /// A fresh stored answer, served as the client asked for it.
    pub(super) async fn fresh(
        &self,
        reply: &Reply<'_>,
        render: &mut Option<Box<dyn StreamRender>>,
    ) -> Option<Response<Body>> {
        let hit = self.cache.fresh(&self.ask).await?;
        Some(self.serve(&hit, "hit", reply, render.take()))
    }

    /// After the walk: when no target answered (502, 503, 504), an answer
    /// at most `stale_if_error` old instead; else the walk's response, told
    /// whether the cache was asked.
    pub(super) async fn after(
        &self,
        mut resp: Response<Body>,
        reply: &Reply<'_>,
        render: Option<Box<dyn StreamRender>>,
    ) -> Response<Body> {
        let unanswered = matches!(resp.status().as_u16(), 502..=504);
        if unanswered {
            if let Some(hit) = self.cache.stale(&self.ask).await {
                warn!(
                    status = resp.status().as_u16(),
                    age_s = hit.age.as_secs(),
                    "no target answered: serving a stale answer from the cache"
                );
                return self.serve(&hit, "stale", reply, render);
            }
        }
        let result = if self.ask.lookup() { "miss" } else { "bypass" };
        self.cache.count(result);
        reply.trace.cache(result);
        respond::cache_result(&mut resp, result, None);
        resp
    }

    /// A stored answer as the response: the completion with a fresh id, or
    /// the stream that carries it (in the client's protocol).
    fn serve(
        &self,
        hit: &Hit,
        result: &'static str,
        reply: &Reply<'_>,
        render: Option<Box<dyn StreamRender>>,
    ) -> Response<Body> {
        self.cache.count(result);
        self.cache.saved(&hit.entry);
        reply.trace.cache(result);
        let completion = hit.entry.completion();
        let events = reply
            .stream
            .then(|| crate::sse::events_of_completion(&completion, reply.include_usage))
            .flatten();
        let mut resp = match events {
            None => respond::completion(StatusCode::OK, completion),
            Some(mut events) => {
                if let Some(mut render) = render {
                    let mut out = BytesMut::new();
                    native::render_events(render.as_mut(), &events, &mut out);
                    render.done(&mut out);
                    events = out.freeze();
                }
                reply.trace.committed();
                reply.trace.stream_end("complete", false);
                respond::stream(body::full(events))
            }
        };
        respond::no_calls(&mut resp, reply.request_id);
        respond::cache_result(&mut resp, result, Some(hit.age.as_secs()));
        resp
    }
}
