//! A stream after its commit point: events are relayed as they arrive, and
//! how the stream ended is handed to [`classify::end_of_stream`] for the
//! verdict that health, metrics and the client's last events follow.
//!
//! The relay is the response body itself, pulled by hyper's connection task:
//! no task and no channel per stream. Events parsed from one upstream read
//! (and frames hyper has already read) go out in one write. When the client
//! hangs up, hyper drops the body, and the relay's drop counts it as the
//! client's doing, against no target.

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use tokio::time::{timeout_at, Instant};
use tracing::{debug, info, warn, Instrument};

use super::attempt::{self, Commit, RelayState};
use super::continuation::{Recovery, Resumed, Seam, Splice, Spliced};
use crate::body::{self, Body, DrainWatch};
use crate::cache;
use crate::classify::{self, AttemptOutcome, Interruption, StreamEnd, StreamVerdict};
use crate::health::{Failure, Permit};
use crate::native::StreamRender;
use crate::schema::HOLD_MAX_TOOL_BYTES;
use crate::sse::{self, Chunk};

/// Relayed bytes batched before a write to the client, at most.
const BATCH_MAX_BYTES: usize = 64 * 1024;

/// A committed stream being relayed.
#[derive(Debug)]
pub struct Relay {
    state: RelayState,
    permit: Option<Permit>,
    /// Bytes ready for the client, in order.
    out: VecDeque<Bytes>,
    /// Events parsed but not yet handed out (one write's worth).
    batch: BytesMut,
    usage: Option<(u64, u64)>,
    content_chunks: u64,
    /// The verdict is in; nothing more will be read.
    over: bool,
    span: tracing::Span,
    /// What continuing this stream on another target needs, when its task does.
    recovery: Option<Box<Recovery>>,
    /// Rewrites a continuing upstream's events into the client's stream.
    splice: Option<Splice>,
    /// The seam of the continuation in progress, for its result.
    seam: Option<Seam>,
    /// Ends the stream when switchyard's drain timeout passes.
    drain: DrainWatch,
    /// The error table's verdict on an in-band error event that broke the
    /// stream (an account out of credit cools its provider, as before the
    /// commit point).
    in_band: Option<classify::Decision>,
    /// What that error event said, for the interruption to repeat.
    said: Option<sse::UpstreamSaid>,
    /// Renders each event in the client's protocol, when it speaks another;
    /// else the events go out as they are.
    render: Option<Box<dyn StreamRender>>,
    /// The answer folded as it goes out, to be cached if the stream ends
    /// complete on the target it started on.
    kept: Option<(cache::Fill, cache::Collector)>,
}

/// What happened to a broken stream that might be continued.
enum Continued {
    /// Not continued: conclude as usual.
    No,
    /// Another target carries the stream on.
    Yes,
    /// No target could: ended with the interruption, verdicts recorded.
    Ended,
}

impl Relay {
    /// A relay whose first bytes are what the commit point held back.
    /// `span` is what its log lines and its end run in: the attempt's span
    /// with tracing on (so it lasts to the stream's end), else the request's.
    #[must_use]
    pub fn new(
        commit: Commit,
        recovery: Option<Box<Recovery>>,
        span: tracing::Span,
        drain: DrainWatch,
        render: Option<Box<dyn StreamRender>>,
        fill: Option<cache::Fill>,
    ) -> Self {
        let mut relay = Self {
            state: commit.state,
            permit: Some(commit.permit),
            out: VecDeque::new(),
            batch: BytesMut::new(),
            usage: None,
            content_chunks: 0,
            over: false,
            span,
            recovery,
            splice: None,
            seam: None,
            drain,
            in_band: None,
            said: None,
            render,
            kept: fill.map(|fill| (fill, cache::Collector::default())),
        };
        for event in &commit.held {
            // What the commit point held went out too: its tokens count.
            if matches!(sse::classify_event(event), Chunk::Content { .. }) {
                relay.content_chunks += 1;
            }
            relay.write_event(event);
            if let (Some(recovery), Some(data)) = (&mut relay.recovery, &event.data) {
                recovery.observe(data);
            }
        }
        relay
    }

    /// The relay as a response body.
    #[must_use]
    pub fn into_body(self) -> Body {
        // Boxed: the unfold moves its state in and out on every frame.
        let stream = futures_util::stream::unfold(Box::new(self), |mut relay| async move {
            let bytes = relay.next().await?;
            Some((bytes, relay))
        });
        body::streamed(stream)
    }

    /// Runs `f` in the relay's spans. Only what may log or start an attempt
    /// does (a dropped event, a contract check, the stream's end): entering
    /// and leaving two spans would cost each relayed event about as much
    /// as reading it.
    fn in_spans<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        let (span, log) = (self.span.clone(), self.log_span());
        let _span = span.enter();
        let _log = log.enter();
        f(self)
    }

    /// The request's log span when the relay's own span is an attempt span
    /// (tracing on); else none (the relay's span is the request's already).
    fn log_span(&self) -> tracing::Span {
        if crate::telemetry::tracing_on() {
            self.state.account.trace.log_span().clone()
        } else {
            tracing::Span::none()
        }
    }

    /// The next bytes for the client; `None` once the stream is over.
    async fn next(&mut self) -> Option<Bytes> {
        loop {
            if let Some(next) = self.out.pop_front() {
                if next.is_empty() {
                    continue;
                }
                // An upstream that echoes its own key never hands it on.
                let secrets = self.state.target.provider.secrets();
                return Some(crate::sanitize::redact_secrets(next, secrets));
            }
            if self.over {
                let mut last = BytesMut::new();
                self.render.take()?.done(&mut last);
                let secrets = self.state.target.provider.secrets();
                return (!last.is_empty())
                    .then(|| crate::sanitize::redact_secrets(last.freeze(), secrets));
            }
            if let Some(end) = self.advance().await {
                // With tracing on, `span` is the attempt's (which log lines
                // do not show): the request's own is entered inside it.
                let (span, log) = (self.span.clone(), self.log_span());
                async {
                    let end = self.settled(end);
                    match self.continue_on_next(end).await {
                        Continued::No => self.conclude(end),
                        Continued::Yes | Continued::Ended => {}
                    }
                }
                .instrument(span)
                .instrument(log)
                .await;
            }
        }
    }

    /// After a `finish_reason` the answer is whole: a connection that then
    /// breaks, stalls or outlives the deadline ends a complete stream
    /// (`[DONE]` added), never a broken one to report or continue.
    fn settled(&self, end: StreamEnd) -> StreamEnd {
        let cut_off = matches!(
            end,
            StreamEnd::BodyError | StreamEnd::Idle | StreamEnd::Deadline | StreamEnd::Drain
        );
        if cut_off && self.state.finished {
            StreamEnd::Eof { finished: true }
        } else {
            end
        }
    }

    /// Moves the stream on: parses what is buffered, then reads more. Returns
    /// how the stream ended once it has.
    async fn advance(&mut self) -> Option<StreamEnd> {
        if let Some(end) = self.take_events() {
            return Some(end);
        }
        let s = &mut self.state;
        if s.done {
            return Some(StreamEnd::Done);
        }
        if s.eof {
            return Some(StreamEnd::Eof {
                finished: s.finished,
            });
        }
        // hyper hands a chunked body over one frame (one HTTP chunk; most
        // upstreams send one SSE event per chunk) at a time. Frames it has
        // already read join this batch (after one scheduler turn for its
        // connection task to decode the next); the batch goes out when the
        // next frame must be waited for.
        let mut ready = None;
        if self.batch.len() < BATCH_MAX_BYTES {
            ready = futures_util::FutureExt::now_or_never(s.incoming.frame());
            if ready.is_none() && !self.batch.is_empty() {
                tokio::task::yield_now().await;
                ready = futures_util::FutureExt::now_or_never(s.incoming.frame());
            }
        }
        let frame = match ready {
            Some(frame) => frame,
            None if !self.batch.is_empty() => {
                self.out.push_back(self.batch.split().freeze());
                return None;
            }
            None => {
                let idle_deadline = s
                    .deadline
                    .min(Instant::now() + s.target.provider.idle_timeout);
                tokio::select! {
                    read = timeout_at(idle_deadline, s.incoming.frame()) => match read {
                        Ok(frame) => frame,
                        Err(_) if idle_deadline >= s.deadline => return Some(StreamEnd::Deadline),
                        Err(_) => return Some(StreamEnd::Idle),
                    },
                    () = self.drain.cut() => return Some(StreamEnd::Drain),
                }
            }
        };
        match frame {
            None => {
                s.eof = true;
                s.events.finish();
            }
            Some(Err(_)) => return Some(StreamEnd::BodyError),
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    if s.events.push(&data).is_err() {
                        // Corrupt compressed data: the stream is broken.
                        return Some(StreamEnd::BodyError);
                    }
                    if s.events.pending() > sse::MAX_EVENT_BYTES {
                        return Some(StreamEnd::EventTooLarge);
                    }
                }
            }
        }
        None
    }

    /// Moves complete buffered events into the batch; the stream's end if an
    /// event ends it.
    fn take_events(&mut self) -> Option<StreamEnd> {
        // Room for everything buffered, so the batch is allocated once per write.
        self.batch.reserve(self.state.events.pending());
        while let Some(event) = self.state.events.next_event(self.state.eof) {
            if self.state.done {
                break;
            }
            match sse::classify_event(&event) {
                Chunk::Malformed => {
                    self.in_spans(
                        |s| debug!(target = %s.state.target.name, "dropping malformed event"),
                    );
                    self.state.target.metrics.malformed.increment(1);
                    // What went out lacks that event: no whole answer to keep.
                    self.kept = None;
                    continue;
                }
                Chunk::Error { code } => {
                    let data = event.data.as_deref().unwrap_or("").as_bytes();
                    let headers = http::HeaderMap::new();
                    let (decision, status) = self.in_spans(|s| {
                        attempt::in_band_verdict(&s.state.target, code, &headers, data)
                    });
                    self.in_band = Some(decision);
                    let data = event.data.as_deref().unwrap_or("");
                    let (sanitizer, target) = (&self.state.sanitizer, &self.state.target);
                    self.said = Some(sse::UpstreamSaid::of(status, data, |message| {
                        let keys: Vec<&str> = target.provider.secrets().collect();
                        sanitizer
                            .message_for(status)
                            .map_or_else(|| sanitizer.clean_text(message, &keys), str::to_owned)
                    }));
                    return Some(StreamEnd::InBandError);
                }
                Chunk::Done => self.state.done = true,
                Chunk::Content { finished } => {
                    self.content_chunks += 1;
                    self.state.finished |= finished;
                    let trace = &self.state.account.trace;
                    if let (true, Some(data)) = (finished && trace.wants_finish(), &event.data) {
                        let _ = trace.answer_meta(data.as_bytes());
                    }
                    if let (Some(_), Some(data)) = (&self.state.contract, &event.data) {
                        let (tool, text) = self.state.calls.push_chunk(data);
                        if tool && !text && !finished {
                            self.state.tool_held_bytes += event.held_bytes();
                            self.state.tool_held.push(event);
                            if self.state.tool_held_bytes > HOLD_MAX_TOOL_BYTES {
                                return Some(StreamEnd::ContractViolation);
                            }
                            continue;
                        }
                    }
                }
                Chunk::NoContent { finished } => {
                    if let Some(data) = &event.data {
                        if data.contains("\"usage\"") {
                            self.usage = sse::usage(data.as_bytes()).or(self.usage);
                        }
                        let trace = &self.state.account.trace;
                        if finished && trace.wants_finish() {
                            let _ = trace.answer_meta(data.as_bytes());
                        }
                    }
                    self.state.finished |= finished;
                }
                // Behind a held call (the end of an upstream block a client
                // of its protocol gets): held with it, in order.
                Chunk::Empty if !self.state.tool_held.is_empty() => {
                    self.state.tool_held_bytes += event.held_bytes();
                    self.state.tool_held.push(event);
                    continue;
                }
                Chunk::Empty => {}
            }
            let ended = self.state.finished || self.state.done;
            if ended
                && self.state.contract.is_some()
                && self.in_spans(Self::release_tool_calls).is_err()
            {
                return Some(StreamEnd::ContractViolation);
            }
            let spliced = self.splice.as_mut().map(|s| s.event(&event));
            let data = match spliced {
                None | Some(Spliced::Raw) => {
                    self.write_event(&event);
                    event.data
                }
                Some(Spliced::Drop) => continue,
                Some(Spliced::Diverged) => return Some(StreamEnd::Diverged),
                Some(Spliced::Data(data)) => Some(self.write_data(data)),
            };
            if let (Some(recovery), Some(data)) = (&mut self.recovery, data) {
                recovery.observe(&data);
            }
        }
        None
    }

    /// At the end of the answer: checks the held tool calls and sends them
    /// (after what is batched) if they keep the contract.
    fn release_tool_calls(&mut self) -> Result<(), ()> {
        let Some(contract) = self.state.contract.take() else {
            return Ok(());
        };
        let calls = self.state.calls.calls();
        if let Err(v) = contract.check_calls(&calls) {
            let s = &self.state;
            // Past the commit point the headers are out: a repair shows in
            // the metrics, the log and the trace only.
            let held = attempt::chat_bytes(s.tool_held.iter());
            let fixed = attempt::try_repairs(&s.account.task, &s.target, &v, |_| {
                let fixed = contract.repair_calls(&calls)?;
                Some(fixed.and_then(|fixed| s.calls.repaired_events(&held, &fixed)))
            });
            let Some((_, events)) = fixed else {
                warn!(target = %s.target.name, violation = %v, "tool call breaks the contract after text was sent");
                s.account
                    .task
                    .route_metrics(Some(&s.target))
                    .violations
                    .increment(1);
                return Err(());
            };
            self.state.tool_held.clear();
            self.state.tool_held_bytes = 0;
            self.release(sse::events_of(&events));
            return Ok(());
        }
        let held = std::mem::take(&mut self.state.tool_held);
        self.state.tool_held_bytes = 0;
        self.release(held);
        Ok(())
    }

    /// Sends held events on: through the splice of a continued stream (so
    /// they carry the stream's own id), else as they came.
    fn release(&mut self, held: Vec<sse::Event>) {
        for event in held {
            let Some(splice) = self.splice.as_mut() else {
                self.write_event(&event);
                continue;
            };
            match splice.event(&event) {
                Spliced::Raw | Spliced::Diverged => self.write_event(&event),
                Spliced::Drop => {}
                Spliced::Data(data) => {
                    self.write_data(data);
                }
            }
        }
    }

    /// One event into the batch: rendered for the client, or as it is.
    fn write_event(&mut self, event: &sse::Event) {
        if let (Some((_, collected)), Some(data)) = (&mut self.kept, &event.data) {
            collected.push(data);
        }
        match &mut self.render {
            Some(render) => render.event(event, &mut self.batch),
            None => self.batch.extend_from_slice(&event.raw),
        }
    }

    /// An event the splice rewrote (its data) into the batch; the data back.
    fn write_data(&mut self, data: String) -> String {
        if let Some((_, collected)) = &mut self.kept {
            collected.push(&data);
        }
        match &mut self.render {
            Some(render) => {
                let event = sse::Event {
                    raw: Bytes::new(),
                    data: Some(data),
                    malformed: false,
                    reading: None,
                    upstream: crate::sse::Upstream::Chat,
                };
                render.event(&event, &mut self.batch);
                event.data.unwrap_or_default()
            }
            None => {
                self.batch.extend_from_slice(b"data: ");
                self.batch.extend_from_slice(data.as_bytes());
                self.batch.extend_from_slice(b"\n\n");
                data
            }
        }
    }

    /// switchyard's own events (the held start, an interruption, the end),
    /// after what is batched: rendered for the client, or as they are.
    fn push_raw(&mut self, raw: Bytes) {
        match &mut self.render {
            Some(render) => {
                let mut out = BytesMut::new();
                crate::native::render_events(render.as_mut(), &raw, &mut out);
                self.out.push_back(out.freeze());
            }
            None => self.out.push_back(raw),
        }
    }

    /// A stream broken after its commit point, when its task continues broken
    /// streams: the broken target's verdict is recorded as always, and the
    /// next admitted target carries the answer on.
    async fn continue_on_next(&mut self, end: StreamEnd) -> Continued {
        let StreamVerdict::Interrupted(why) = classify::end_of_stream(end) else {
            return Continued::No;
        };
        // Held tool calls cannot be continued; JSON text streams as any text.
        let under_validation = self
            .state
            .contract
            .as_ref()
            .is_some_and(|c| c.offers_tools());
        match &self.recovery {
            Some(r) if r.can_continue(why, under_validation) => {}
            Some(_) | None => return Continued::No,
        }
        self.out.push_back(self.batch.split().freeze());
        self.settle_seam(StreamVerdict::Interrupted(why));
        self.record_source(StreamVerdict::Interrupted(why));
        let broken = Arc::clone(&self.state.target);
        let Some(recovery) = self.recovery.as_mut() else {
            return Continued::No;
        };
        let resumed = tokio::select! {
            resumed = recovery.resume(&broken) => Some(resumed),
            () = self.drain.cut() => None,
        };
        match resumed {
            Some(Ok(resumed)) => {
                self.adopt(resumed);
                Continued::Yes
            }
            Some(Err(())) => {
                recovery.count_failed(&broken);
                self.push_raw(sse::interrupt_events(why.label(), self.said.as_ref()));
                self.over = true;
                Continued::Ended
            }
            None => {
                // The drain timeout passed while the next target was sought.
                warn!(task = %self.state.account.task.name, "stream cut at drain_timeout while being continued");
                self.state.account.trace.stream_end("drain", true);
                self.push_raw(sse::drain_events());
                self.over = true;
                Continued::Ended
            }
        }
    }

    /// Carries on with the target that took over.
    fn adopt(&mut self, resumed: Resumed) {
        let Resumed {
            commit,
            splice,
            seam,
            span,
        } = resumed;
        // The broken attempt's span ends here; the relay goes on in the new one's.
        if !span.is_disabled() {
            self.span = span;
        }
        if self.recovery.as_ref().is_some_and(|r| r.seam_comment()) {
            let comment = format!(
                ": switchyard continued this answer from {} on {} ({})\n\n",
                seam.from.name,
                seam.to.name,
                seam.mode.label()
            );
            self.push_raw(Bytes::from(comment));
        }
        self.state = commit.state;
        let to = &self.state.target;
        self.state
            .account
            .trace
            .continued(&to.name, &to.provider.name);
        self.permit = Some(commit.permit);
        // A continued answer is two targets' work: never cached.
        self.kept = None;
        self.usage = None;
        self.said = None;
        self.content_chunks = 0;
        self.splice = Some(splice);
        self.seam = Some(seam);
        // What its commit point held goes through the splice like the rest.
        self.state.events.requeue(commit.held);
    }

    /// Counts the result of the continuation in progress, if any.
    fn settle_seam(&mut self, verdict: StreamVerdict) {
        let (Some(seam), Some(recovery)) = (self.seam.take(), &self.recovery) else {
            return;
        };
        let result = match verdict {
            StreamVerdict::Complete { .. } => "completed",
            StreamVerdict::Interrupted(Interruption::Diverged) => "diverged",
            StreamVerdict::Interrupted(_) => "interrupted",
            StreamVerdict::ClientGone => "cancelled",
            StreamVerdict::Drained => "drain",
        };
        recovery.count(&seam, result);
    }

    /// The stream ended: its last bytes go out, and the verdict is recorded.
    fn conclude(&mut self, end: StreamEnd) {
        let mut end = end;
        if let StreamEnd::Eof { finished: true } = end {
            if self.release_tool_calls().is_err() {
                end = StreamEnd::ContractViolation;
            }
        }
        self.out.push_back(self.batch.split().freeze());
        let verdict = classify::end_of_stream(end);
        if let (StreamVerdict::Complete { .. }, Some((fill, collected))) =
            (verdict, self.kept.take())
        {
            let target = &self.state.target;
            fill.stream(collected, |prompt, completion| {
                target.usd(prompt, completion)
            });
        }
        match verdict {
            StreamVerdict::Complete { add_done: true } => {
                // Ended cleanly without the sentinel: add it, never wait for it.
                self.push_raw(Bytes::from_static(sse::DONE));
            }
            StreamVerdict::Complete { add_done: false } | StreamVerdict::ClientGone => {}
            StreamVerdict::Interrupted(why) => {
                self.push_raw(sse::interrupt_events(why.label(), self.said.as_ref()));
            }
            StreamVerdict::Drained => self.push_raw(sse::drain_events()),
        }
        self.record(verdict);
    }

    /// Books the answer and records the verdict; the stream is over.
    fn record(&mut self, verdict: StreamVerdict) {
        self.over = true;
        self.settle_seam(verdict);
        self.record_source(verdict);
    }

    /// Books the current upstream's part and records its verdict against its target.
    fn record_source(&mut self, verdict: StreamVerdict) {
        let Some(permit) = self.permit.take() else {
            return;
        };
        let target = Arc::clone(&self.state.target);
        self.state
            .account
            .settle(&target, self.usage, self.content_chunks);
        let (end, interrupted) = match verdict {
            StreamVerdict::Complete { .. } => ("complete", false),
            StreamVerdict::Interrupted(why) => (why.label(), true),
            StreamVerdict::ClientGone => ("client_gone", false),
            StreamVerdict::Drained => ("drain", true),
        };
        self.state.account.trace.stream_end(end, interrupted);
        match verdict {
            StreamVerdict::Complete { .. } => {
                attempt::book(
                    &self.state.health,
                    &target,
                    AttemptOutcome::Success,
                    permit,
                    None,
                );
            }
            StreamVerdict::Interrupted(why) => {
                let reason = why.label();
                warn!(target = %target.name, reason, "stream interrupted after the commit point");
                target.metrics.interrupts.increment(reason, 1);
                if let Some(decision) = self.in_band.take() {
                    // Where the error table puts it: the provider for an
                    // account out of credit, the key for a revoked one.
                    let (cfg, key) = (&self.state.health, self.state.key);
                    let outcome = AttemptOutcome::StreamInterrupted;
                    attempt::record(cfg, &target, &decision, outcome, permit, key);
                    return;
                }
                // A restart that said something else answered all the same:
                // the divergence ends the stream, it is not the target's failure.
                let counted = why != Interruption::Diverged;
                let failure = Failure::new(counted, None, false, Arc::from("stream_interrupted"));
                attempt::book(
                    &self.state.health,
                    &target,
                    AttemptOutcome::StreamInterrupted,
                    permit,
                    Some(&failure),
                );
            }
            StreamVerdict::ClientGone => {
                info!(task = %self.state.account.task.name, target = %target.name, "client hung up mid-stream");
                self.state.account.task.cancelled.increment(1);
                drop(permit);
            }
            StreamVerdict::Drained => {
                warn!(task = %self.state.account.task.name, target = %target.name, "stream cut at drain_timeout");
                drop(permit);
            }
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        if !self.over {
            let _log = self.log_span().entered();
            let _entered = self.span.clone().entered();
            // Dropped at shutdown after the drain timeout, or by hyper
            // because the client left.
            let verdict = if self.drain.is_cut() {
                StreamVerdict::Drained
            } else {
                StreamVerdict::ClientGone
            };
            self.record(verdict);
        }
    }
}
