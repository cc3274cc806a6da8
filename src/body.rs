//! Response bodies: known bytes, a stream pulled from an async source (the
//! relay), and a wrapper that holds a slot of the concurrency cap until the
//! body ends.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures_util::Stream;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use tokio::sync::OwnedSemaphorePermit;

/// The response body type of every endpoint.
pub type Body = UnsyncBoxBody<Bytes, Infallible>;

/// A body of known bytes.
#[must_use]
pub fn full(bytes: Bytes) -> Body {
    Full::new(bytes).boxed_unsync()
}

/// A body whose chunks come from `stream`, polled by hyper's connection task
/// itself (no task or channel in between). When the client goes away hyper
/// drops the body, and with it the stream: that drop is how the relay learns.
#[must_use]
pub fn streamed(stream: impl Stream<Item = Bytes> + Send + 'static) -> Body {
    use futures_util::StreamExt as _;
    StreamBody::new(stream.map(|b| Ok::<_, Infallible>(Frame::data(b)))).boxed_unsync()
}

/// The cut at the end of the drain: when `drain_timeout` passes, streamed
/// bodies still running end with a `drain` error event (and their verdict
/// is logged as a drain, not as a client that hung up).
#[derive(Debug)]
pub struct Drain(tokio::sync::watch::Sender<bool>);

impl Default for Drain {
    fn default() -> Self {
        Drain(tokio::sync::watch::channel(false).0)
    }
}

impl Drain {
    /// The drain timeout passed: cut every stream still running.
    pub fn cut(&self) {
        self.0.send_replace(true);
    }

    /// What one streamed body watches.
    #[must_use]
    pub fn watch(&self) -> DrainWatch {
        DrainWatch(self.0.subscribe())
    }
}

/// One streamed body's view of the [`Drain`].
#[derive(Debug)]
pub struct DrainWatch(tokio::sync::watch::Receiver<bool>);

impl DrainWatch {
    /// Whether the drain timeout has passed.
    #[must_use]
    pub fn is_cut(&self) -> bool {
        *self.0.borrow()
    }

    /// Resolves when the drain timeout passes (never, if the gateway is gone).
    pub async fn cut(&mut self) {
        if self.0.wait_for(|cut| *cut).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// A body that holds a slot of `max_concurrent_requests` until it is finished
/// or dropped, so a long stream keeps its slot.
#[must_use]
pub fn holding(inner: Body, permit: OwnedSemaphorePermit) -> Body {
    PermitBody {
        inner,
        _permit: permit,
    }
    .boxed_unsync()
}

struct PermitBody {
    inner: Body,
    _permit: OwnedSemaphorePermit,
}

impl hyper::body::Body for PermitBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// Why [`read_all`] read no whole body.
#[derive(Debug)]
pub enum ReadError<E> {
    /// More than the limit.
    TooLarge,
    /// The body's own error (a broken connection, say).
    Body(E),
}

/// Reads a whole body of at most `limit` bytes. A body that comes as one
/// frame (nearly every request and answer) is kept as it came: no copy and no
/// list of frames, which is what `collect` would allocate.
///
/// # Errors
/// More than `limit` bytes, or the body's error.
pub async fn read_all<B>(mut body: B, limit: usize) -> Result<Bytes, ReadError<B::Error>>
where
    B: hyper::body::Body<Data = Bytes> + Unpin,
{
    let mut first: Option<Bytes> = None;
    let mut joined: Option<bytes::BytesMut> = None;
    let mut total = 0usize;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.map_err(ReadError::Body)?.into_data() else {
            continue; // trailers carry no body bytes
        };
        total = total.saturating_add(data.len());
        if total > limit {
            return Err(ReadError::TooLarge);
        }
        match (&mut joined, first.take()) {
            (Some(buf), _) => buf.extend_from_slice(&data),
            (None, None) => first = Some(data),
            (None, Some(head)) => {
                let mut buf = bytes::BytesMut::with_capacity(head.len() + data.len());
                buf.extend_from_slice(&head);
                buf.extend_from_slice(&data);
                joined = Some(buf);
            }
        }
    }
    Ok(match joined {
        Some(buf) => buf.freeze(),
        None => first.unwrap_or_default(),
    })
}
