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
