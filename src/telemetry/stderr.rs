//! Where log lines go: stderr, written in batches by a thread of its own.
//!
//! A line is formatted where it happens and appended to one shared buffer
//! (its lock held for the copy only, so lines keep the order they were
//! logged in); a flusher thread takes the buffer and writes it out each
//! [`FLUSH_EVERY`]. So a request never waits on stderr's lock or on a
//! `write(2)`, and no thread is woken per line (as a channel to a writer
//! thread would wake it for each line a quiet gateway logs). Should stderr
//! stall (a collector that stops reading a full pipe), the buffer stops at
//! [`MAX_BUFFERED`] and later lines are dropped rather than held.

use std::io::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

/// How often the flusher writes what was logged.
pub const FLUSH_EVERY: Duration = Duration::from_millis(25);

/// Most bytes waiting to be written before later lines are dropped.
pub const MAX_BUFFERED: usize = 4 << 20;

#[derive(Default)]
struct Shared {
    lines: Mutex<Vec<u8>>,
    stop: AtomicBool,
}

impl Shared {
    /// Writes out what was logged (the flusher's turn, and the last one).
    fn flush(&self, spare: &mut Vec<u8>) {
        spare.clear();
        std::mem::swap(&mut *self.lines.lock(), spare);
        if spare.is_empty() {
            return;
        }
        let mut out = std::io::stderr().lock();
        // Nowhere to report a failed write to stderr.
        let _ = out.write_all(spare);
        let _ = out.flush();
    }
}

/// The `MakeWriter` of the log layer.
#[derive(Clone)]
pub struct Batched {
    shared: Arc<Shared>,
}

/// Keeps the flusher running; dropped at exit, it writes out what is left.
#[must_use = "lines still buffered when it drops are written then; drop it at exit"]
pub struct Flusher {
    shared: Arc<Shared>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Flusher {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            thread.thread().unpark();
            let _ = thread.join();
        }
        self.shared.flush(&mut Vec::new());
    }
}

impl Batched {
    /// Appends what `write` writes as one piece, unless the buffer is full
    /// (stderr stalled): the piece is then dropped, never waited on.
    pub fn append_with(&self, write: impl FnOnce(&mut Vec<u8>)) {
        let mut lines = self.shared.lines.lock();
        let before = lines.len();
        write(&mut lines);
        if lines.len() > MAX_BUFFERED {
            lines.truncate(before);
        }
    }
}

/// The writer, and the guard of its flusher thread.
///
/// # Errors
/// The flusher thread cannot be started.
pub fn batched() -> std::io::Result<(Batched, Flusher)> {
    let shared = Arc::new(Shared::default());
    let flusher = Arc::clone(&shared);
    let thread = std::thread::Builder::new()
        .name("switchyard-log".into())
        .spawn(move || {
            // Two buffers taking turns: neither side allocates in the steady state.
            let mut spare = Vec::new();
            while !flusher.stop.load(Ordering::Acquire) {
                std::thread::park_timeout(FLUSH_EVERY);
                flusher.flush(&mut spare);
            }
        })?;
    Ok((
        Batched {
            shared: Arc::clone(&shared),
        },
        Flusher {
            shared,
            thread: Some(thread),
        },
    ))
}

/// One line's writer: appends to the shared buffer.
pub struct Line<'a> {
    writer: &'a Batched,
}

impl std::io::Write for Line<'_> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.writer
            .append_with(|lines| lines.extend_from_slice(bytes));
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Batched {
    type Writer = Line<'a>;

    fn make_writer(&'a self) -> Self::Writer {
        Line { writer: self }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::fmt::MakeWriter as _;

    #[test]
    fn lines_keep_their_order_and_a_full_buffer_drops_never_blocks() {
        let writer = Batched {
            shared: Arc::new(Shared::default()),
        };
        writer.make_writer().write_all(b"first\n").unwrap();
        writer.make_writer().write_all(b"second\n").unwrap();
        assert_eq!(&*writer.shared.lines.lock(), b"first\nsecond\n");
        let line = vec![b'x'; 1000];
        for _ in 0..(MAX_BUFFERED / 1000 + 50) {
            writer.make_writer().write_all(&line).unwrap();
        }
        let held = writer.shared.lines.lock().len();
        assert!(held <= MAX_BUFFERED && held > MAX_BUFFERED - 1000, "{held}");
        let mut spare = Vec::new();
        writer.shared.flush(&mut spare);
        assert!(writer.shared.lines.lock().is_empty(), "taken by the flush");
    }
}
