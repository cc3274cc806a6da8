//! How an accepted connection is served: HTTP/1.1 (keep-alive) or HTTP/2
//! prior knowledge (h2c), told apart by the first bytes the client sent.
//!
//! Those bytes are peeked, not read, so hyper's HTTP/1 reader gets the whole
//! request head in its first read. (hyper-util's `auto` connection reads
//! them itself and hands them on as a read of their own, after which the
//! head's buffer grows from 8 to 16 KiB on every connection; and it waits
//! for the rest of a partial preface without a deadline.)

use std::time::Duration;

use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tokio::net::TcpStream;
use tokio::time::Instant;

/// What a prior-knowledge HTTP/2 client sends first.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// How long to wait before peeking again at a connection that has sent part
/// of the HTTP/2 preface (a peek does not wait for more bytes).
const PEEK_AGAIN: Duration = Duration::from_millis(5);

/// The protocol a connection's first bytes say it speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Sniffed {
    Http1,
    Http2,
    /// Nothing to tell by within the wait: no byte, only part of the
    /// preface, or a connection that closed or broke.
    Silent,
}

/// Peeks at a connection's first bytes, for at most `wait`.
pub(super) async fn sniff(stream: &TcpStream, wait: Duration) -> Sniffed {
    let deadline = Instant::now() + wait;
    let mut first = [0; PREFACE.len()];
    loop {
        let n = match tokio::time::timeout_at(deadline, stream.peek(&mut first)).await {
            Ok(Ok(n)) if n > 0 => n,
            Ok(Ok(_) | Err(_)) | Err(_) => return Sniffed::Silent,
        };
        if first[..n] != PREFACE[..n] {
            return Sniffed::Http1;
        }
        if n == PREFACE.len() {
            return Sniffed::Http2;
        }
        if Instant::now() + PEEK_AGAIN >= deadline {
            return Sniffed::Silent;
        }
        tokio::time::sleep(PEEK_AGAIN).await;
    }
}

/// hyper's connection builders, set up alike.
pub(super) struct Builders {
    pub(super) http1: http1::Builder,
    pub(super) http2: http2::Builder<TokioExecutor>,
}

/// The limits both builders apply.
pub(super) struct Limits {
    /// The slowloris guard: a request head must arrive within this.
    pub(super) header_read: Duration,
    pub(super) max_headers: usize,
    pub(super) max_head_bytes: usize,
}

impl Builders {
    pub(super) fn new(limits: &Limits) -> Self {
        let mut http1 = http1::Builder::new();
        http1
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_read)
            .max_headers(limits.max_headers)
            .max_buf_size(limits.max_head_bytes);
        let mut http2 = http2::Builder::new(TokioExecutor::new());
        http2.max_header_list_size(u32::try_from(limits.max_head_bytes).unwrap_or(u32::MAX));
        Self { http1, http2 }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt as _;
    use tokio::net::TcpListener;

    /// A connection to a listener of its own: the client's end, the server's.
    async fn connection() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        (client, server)
    }

    async fn sniffed(first: &[u8]) -> Sniffed {
        let (mut client, server) = connection().await;
        if first.is_empty() {
            client.shutdown().await.unwrap();
        } else {
            client.write_all(first).await.unwrap();
        }
        let sniffed = sniff(&server, Duration::from_secs(5)).await;
        // Peeked, not read: the bytes are still there for hyper.
        if !first.is_empty() {
            let mut again = vec![0; first.len()];
            let n = server.peek(&mut again).await.unwrap();
            assert_eq!(&again[..n], &first[..n]);
        }
        sniffed
    }

    #[tokio::test]
    async fn first_bytes_tell_the_protocol() {
        let request = b"POST /v1/chat/completions HTTP/1.1\r\n";
        assert_eq!(sniffed(request).await, Sniffed::Http1);
        assert_eq!(sniffed(b"PRIX").await, Sniffed::Http1);
        assert_eq!(sniffed(PREFACE).await, Sniffed::Http2);
        assert_eq!(sniffed(b"").await, Sniffed::Silent);
    }

    #[tokio::test]
    async fn a_preface_in_pieces_is_waited_for_until_the_deadline() {
        let (mut client, server) = connection().await;
        client.write_all(&PREFACE[..3]).await.unwrap();
        let rest = async {
            tokio::time::sleep(Duration::from_millis(30)).await;
            client.write_all(&PREFACE[3..]).await.unwrap();
        };
        let (sniffed, ()) = tokio::join!(sniff(&server, Duration::from_secs(5)), rest);
        assert_eq!(sniffed, Sniffed::Http2);

        let (mut client, server) = connection().await;
        client.write_all(&PREFACE[..10]).await.unwrap();
        let started = Instant::now();
        let sniffed = sniff(&server, Duration::from_millis(60)).await;
        assert_eq!(sniffed, Sniffed::Silent);
        assert!(started.elapsed() < Duration::from_secs(2));
    }

    #[tokio::test]
    async fn a_silent_client_is_not_waited_for_past_the_wait() {
        let (_client, server) = connection().await;
        let sniffed = sniff(&server, Duration::from_millis(50)).await;
        assert_eq!(sniffed, Sniffed::Silent);
    }
}
