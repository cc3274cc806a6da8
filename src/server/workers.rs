//! One `current_thread` runtime per core: the acceptor hands each accepted
//! connection to the next worker, whose runtime serves it and every request
//! on it (and their upstream calls, on upstream connections of its own:
//! `upstream::pool`) to the end, on that one thread. What
//! requests share (the snapshot, health, buckets, metrics) is the one `App`;
//! background work (reload, prober, shared state, upkeep) stays on the
//! runtime that runs [`super::Gateway::run`].

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};
use tracing::warn;

use super::{Listener, Server};
use crate::state::App;

/// The longest a worker runtime's timer driver goes without a deadline.
const TIMER_FLOOR: std::time::Duration = std::time::Duration::from_secs(1);

/// An accepted connection on its way to a worker.
type Handoff = (std::net::TcpStream, SocketAddr, Listener);

/// The workers: a channel into each, and each one's end.
pub(super) struct Workers {
    senders: Vec<mpsc::UnboundedSender<Handoff>>,
    done: Vec<oneshot::Receiver<()>>,
    next: usize,
}

impl Workers {
    /// `n` workers serving for `app`; none when `n` is 1 (the calling
    /// runtime serves) or when no worker thread could start.
    pub(super) fn start(n: usize, app: &Arc<App>) -> Self {
        let mut workers = Workers {
            senders: Vec::new(),
            done: Vec::new(),
            next: 0,
        };
        if n <= 1 {
            return workers;
        }
        for i in 0..n {
            let (tx, rx) = mpsc::unbounded_channel();
            let (done_tx, done_rx) = oneshot::channel();
            let app = Arc::clone(app);
            let spawned = std::thread::Builder::new()
                .name(format!("switchyard-worker-{i}"))
                .spawn(move || work(i, app, rx, done_tx));
            match spawned {
                Ok(_) => {
                    workers.senders.push(tx);
                    workers.done.push(done_rx);
                }
                Err(e) => warn!(error = %e, worker = i, "a worker thread did not start"),
            }
        }
        workers
    }

    /// Hands a connection to the next worker; gives it back when there is none.
    pub(super) fn hand(
        &mut self,
        stream: tokio::net::TcpStream,
        peer: SocketAddr,
        kind: Listener,
    ) -> Option<tokio::net::TcpStream> {
        if self.senders.is_empty() {
            return Some(stream);
        }
        let std = match stream.into_std() {
            Ok(std) => std,
            Err(e) => {
                warn!(error = %e, "an accepted connection could not be handed to a worker");
                return None;
            }
        };
        let mut handoff = (std, peer, kind);
        // A worker whose thread died refuses it: the next one takes it.
        for _ in 0..self.senders.len() {
            self.next = (self.next + 1) % self.senders.len();
            match self.senders[self.next].send(handoff) {
                Ok(()) => return None,
                Err(mpsc::error::SendError(back)) => handoff = back,
            }
        }
        warn!("no worker took an accepted connection");
        None
    }

    /// Stops handing out connections and waits until every worker has
    /// drained its own (each within the drain timeout).
    pub(super) async fn drain(self) {
        drop(self.senders);
        for done in self.done {
            let _ = done.await;
        }
    }
}

/// A worker thread: its runtime serves what it is handed until the acceptor
/// stops, then drains.
fn work(
    index: usize,
    app: Arc<App>,
    mut rx: mpsc::UnboundedReceiver<Handoff>,
    done: oneshot::Sender<()>,
) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            // Dropping `rx` sends the acceptor to the other workers.
            warn!(error = %e, "a worker runtime did not start");
            return;
        }
    };
    crate::upstream::pool::own_pools_on_this_thread(index);
    runtime.block_on(async move {
        // tokio wakes its timer driver (an eventfd write, then one more turn
        // of its loop) when a timer is armed earlier than the driver's next
        // deadline. Every request arms one (hyper's 10 s header read timeout,
        // once the answer is out) while the next deadline is an upstream's
        // longer timeout, or none. A deadline always under a second away
        // saves that syscall per request.
        tokio::spawn(async {
            let mut every = tokio::time::interval(TIMER_FLOOR);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
            }
        });
        let server = Server::new(app);
        while let Some((std, peer, kind)) = rx.recv().await {
            match tokio::net::TcpStream::from_std(std) {
                Ok(stream) => server.serve(stream, peer, kind),
                Err(e) => warn!(error = %e, "a handed connection could not be registered"),
            }
        }
        server.drain().await;
    });
    let _ = done.send(());
}
