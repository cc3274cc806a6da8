//! A task's cache at both ends of the walk: a fresh answer served before any
//! target is asked (past the front door's limits, spending no provider's
//! bucket), the walk's answer kept ([`cache::Fill`], handed to the walk),
//! and a stale answer served when the walk ends without one. A semantic
//! cache embeds the prompt through its embeddings task ([`embedding`]) when
//! the exact lookup misses.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use http::header::HeaderValue;
use http::{Response, StatusCode};
use http_body_util::BodyExt as _;
use serde::Deserialize;
use tokio::time::Instant;
use tracing::{debug, warn};

use super::{respond, Exchange};
use crate::body::{self, Body};
use crate::cache::{self, Ask, Hit, Near, Prompt, TaskCache};
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
    /// For a semantic cache: the prompt to embed, then its place in the index.
    prompt: Option<Prompt>,
    near: Option<Near>,
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
            .map_or((Protocol::Chat, &request.bytes()[..]), |n| {
                (n.protocol, n.body)
            });
        let forwarded = crate::upstream::forwardable(headers);
        let ask = cache.ask(protocol, body, headers, &forwarded);
        // Only a semantic cache reads the chat translation (its prompt).
        let prompt = match cache.policy.semantic {
            Some(_) => cache.prompt(&ask, protocol, body, request.bytes()),
            None => None,
        };
        Some(Self {
            cache: Arc::clone(cache),
            prompt,
            ask,
            prompt_tokens,
            near: None,
        })
    }

    /// Where the walk's answer is kept, if it may be.
    pub(super) fn fill(&self) -> Option<cache::Fill> {
        let fill = self.cache.fill(&self.ask, self.prompt_tokens)?;
        Some(fill.near(self.near.clone()))
    }

    /// A fresh stored answer (the same request, else, for a semantic cache,
    /// one that means the same), served as the client asked for it.
    pub(super) async fn fresh(
        &mut self,
        x: &Exchange<'_>,
        reply: &Reply<'_>,
        render: &mut Option<Box<dyn StreamRender>>,
    ) -> Option<Response<Body>> {
        if let Some(hit) = self.cache.fresh(&self.ask).await {
            return Some(self.serve(&hit, "hit", reply, render.take()));
        }
        let prompt = self.prompt.take()?;
        let task = &self.cache.policy.semantic.as_ref()?.embeddings;
        let vector = embedding(x, task, &prompt.text).await?;
        let near = Near {
            rest: prompt.rest,
            vector: vector.into(),
        };
        let hit = self.cache.similar(&self.ask, &near);
        self.near = Some(near);
        Some(self.serve(&hit?, "hit", reply, render.take()))
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
            let semantic = || self.near.as_ref().and_then(|n| self.cache.similar_stale(n));
            if let Some(hit) = self.cache.stale(&self.ask).await.or_else(semantic) {
                warn!(
                    status = resp.status().as_u16(),
                    age_s = hit.age.as_secs(),
                    "no target answered: serving a stale answer from the cache"
                );
                let mut stale = self.serve(&hit, "stale", reply, render);
                // The calls the walk made are this answer's calls too.
                for name in [respond::H_ATTEMPTS, respond::H_FAILOVERS] {
                    if let Some(value) = resp.headers().get(name) {
                        stale.headers_mut().insert(name, value.clone());
                    }
                }
                return stale;
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
        if let Some(similarity) = hit.similarity {
            respond::cache_similarity(&mut resp, similarity);
        }
        resp
    }
}

/// The embedding of `text` by the embeddings task `task`, asked as any
/// request of it is (its own limits, failover and access-log line); `None`
/// when it gives none, and the request is then looked up exactly only.
async fn embedding(x: &Exchange<'_>, task: &str, text: &str) -> Option<Vec<f32>> {
    #[derive(Deserialize)]
    struct Answer {
        data: Vec<Datum>,
    }
    #[derive(Deserialize)]
    struct Datum {
        embedding: Vec<f32>,
    }
    // The client's `x-task-type` names the chat task, not this one.
    let mut headers = x.headers.clone();
    headers.remove(respond::H_TASK_TYPE);
    let body = serde_json::json!({"model": task, "input": text, "encoding_format": "float"});
    let arrival = Instant::now();
    let log = tracing::Span::current();
    let trace = RequestTrace::start(&headers, &x.request_id, arrival, x.snapshot.access_log, log);
    let asked = Exchange {
        snapshot: Arc::clone(&x.snapshot),
        headers: &headers,
        peer: x.peer,
        body: Bytes::from(body.to_string()),
        request_id: x.request_id.clone(),
        arrival,
        native: None,
        trace,
        drain: x.drain,
        render: None,
    };
    let trace = asked.trace.clone();
    let resp = Box::pin(super::embeddings(asked)).await;
    trace.status(resp.status().as_u16());
    if resp.status() != StatusCode::OK {
        debug!(
            task,
            status = resp.status().as_u16(),
            "no embedding for the semantic cache"
        );
        return None;
    }
    let bytes = match resp.into_body().collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(never) => match never {},
    };
    let answer: Answer = serde_json::from_slice(&bytes).ok()?;
    answer.data.into_iter().next().map(|d| d.embedding)
}
