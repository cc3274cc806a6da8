//! Shared state across replicas (`shared_state.redis`): one background task
//! per gateway keeps this replica's live state and the others' in step
//! through Redis (or Valkey). The request path never waits on it: it reads
//! and writes only local state (health, keys, provider cooldowns, the trial
//! gate, the token allowance), and this task carries the differences.
//!
//! Every tick ([`TICK`]) the task
//! 1. publishes what changed locally (a target DOWN with its reopen time or
//!    recovered, cooldowns, a key cooled down or revoked, a provider's
//!    cooldown): each a record with a TTL plus a pub/sub message;
//! 2. takes or lets go half-open trial leases ([`replica::Replica::lease_work`]):
//!    a DOWN target whose trial is due and wanted here gets its trial only
//!    once this replica holds the lease, so one replica tries, not every one;
//! 3. tops up the token allowances from the shared buckets in small blocks.
//!
//! Messages from the others are merged as they arrive; after each connect
//! every record is read and merged (the reconcile) and every local fact is
//! published again. When the store is unreachable or slower than `timeout`
//! the task logs once, sets `switchyard_shared_state_up` to 0, turns the
//! trial gates and allowances back to local behaviour, and reconnects with
//! backoff; nothing a request does waits for it.

pub mod record;
pub mod replica;
pub mod store;

use std::sync::Arc;
use std::time::Duration;

use metrics::Gauge;
use redis::aio::PubSubStream;
use tokio::time::{Instant, MissedTickBehavior};
use tracing::{info, warn};

use crate::metrics as m;
use crate::snapshot::SharedStore;
use crate::state::App;
use record::{Clock, Names};
use replica::{LeaseAction, Replica};
use store::{Store, StoreError};

/// How often local changes are published and leases and allowances tended.
pub const TICK: Duration = Duration::from_millis(50);
/// With nothing else to send, the store is pinged this often (a silent
/// failure is found within about this long).
const PING_EVERY: Duration = Duration::from_secs(1);
/// First reconnect delay; doubled after each failure up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
/// Longest reconnect delay.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// Starts the sync task when the file asks for shared state; runs until the
/// handle is aborted.
#[must_use]
pub fn spawn(app: Arc<App>) -> Option<tokio::task::JoinHandle<()>> {
    let settings = app.startup.shared_state.clone()?;
    let up = app.metrics().gauge(m::SHARED_STATE_UP, &[]);
    up.set(0.0);
    let Some(url) = settings.url.clone() else {
        warn!("shared state: no URL could be read; this replica runs on local state only");
        return None;
    };
    Some(tokio::spawn(run(app, settings, url, up)))
}

async fn run(app: Arc<App>, settings: SharedStore, url: crate::secret::Secret, up: Gauge) {
    let client = match redis::Client::open(url.expose()) {
        Ok(c) => c,
        Err(_) => {
            // Compile checked the URL; this is not expected.
            warn!("shared state: the Redis URL is refused; running on local state only");
            return;
        }
    };
    let names = Names::new(&settings.key_prefix);
    let mut replica = Replica::new(app.metrics());
    let mut backoff = FIRST_BACKOFF;
    // Whether the store's absence was said since it was last there.
    let mut said_down = false;
    loop {
        replica.refresh(&app.snapshot.load_full());
        match Store::connect(&client, names.clone(), settings.timeout).await {
            Ok((mut store, mut messages)) => {
                backoff = FIRST_BACKOFF;
                match resync(&app, &mut replica, &mut store).await {
                    Ok(n) => {
                        up.set(1.0);
                        info!(
                            records = n,
                            "shared state: connected; running on the shared view"
                        );
                        let link = Some(store.connection());
                        app.live.cache_link.set(
                            link.clone(),
                            &settings.key_prefix,
                            settings.timeout,
                        );
                        app.responses.link(
                            link,
                            &settings.key_prefix,
                            names.channel(),
                            settings.timeout,
                        );
                        let why = session(&app, &mut replica, &mut store, &mut messages).await;
                        app.responses
                            .link(None, "", String::new(), settings.timeout);
                        app.live.cache_link.set(None, "", settings.timeout);
                        warn!(error = %why, "shared state: store lost; running on local state and reconnecting");
                        said_down = true;
                    }
                    Err(e) => say_down(&mut said_down, &e),
                }
            }
            Err(e) => say_down(&mut said_down, &e),
        }
        up.set(0.0);
        replica.set_connected(false);
        tokio::time::sleep(jittered(backoff)).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Logs the store's absence once until it is back.
fn say_down(said: &mut bool, e: &StoreError) {
    if !*said {
        warn!(error = %e, "shared state: store unreachable; running on local state and reconnecting");
        *said = true;
    }
}

/// ±20 % of `d`, so replicas that lost the store together do not reconnect in step.
fn jittered(d: Duration) -> Duration {
    d.mul_f64(0.8 + rand::random::<f64>() * 0.4)
}

/// After a connect: the gates and allowances go shared, every record is
/// merged in, and every local fact will be published again. Returns how
/// many records were read.
async fn resync(app: &App, replica: &mut Replica, store: &mut Store) -> Result<usize, StoreError> {
    let records = store.records().await?;
    replica.refresh(&app.snapshot.load_full());
    replica.set_connected(true);
    let clock = Clock::now();
    let n = records.len();
    for message in records {
        replica.apply(message, &clock);
    }
    Ok(n)
}

/// Runs until the store fails: merges messages as they come, and tends the
/// rest each tick.
async fn session(
    app: &App,
    replica: &mut Replica,
    store: &mut Store,
    messages: &mut PubSubStream,
) -> StoreError {
    let mut ticker = tokio::time::interval(TICK);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut last_sent = Instant::now();
    loop {
        tokio::select! {
            message = store::next_message(messages) => match message {
                Ok(store::Heard::Fact(message)) => {
                    replica.apply(message, &Clock::now());
                }
                Ok(store::Heard::Other(text)) => app.responses.heard(&text),
                Err(e) => return e,
            },
            _ = ticker.tick() => {
                replica.refresh(&app.snapshot.load_full());
                match tick(replica, store, &mut last_sent).await {
                    Ok(()) => {}
                    Err(e) => return e,
                }
            }
        }
    }
}

/// One tick: publish, leases, token blocks, and a ping when idle.
async fn tick(
    replica: &mut Replica,
    store: &mut Store,
    last_sent: &mut Instant,
) -> Result<(), StoreError> {
    let clock = Clock::now();
    let now = clock.now;
    let changes = replica.changes(&clock);
    let mut sent = false;
    if !changes.is_empty() {
        store.publish(&changes).await?;
        sent = true;
    }
    for action in replica.lease_work(now) {
        sent = true;
        match action {
            LeaseAction::Acquire { id, hold } => {
                let won = store.acquire(&id, &replica.id, hold).await?;
                replica.leased(&id, won, Instant::now());
            }
            LeaseAction::Release { id, keep } => store.release(&id, &replica.id, keep).await?,
        }
    }
    for (limits, lease) in replica.limit_work(now) {
        sent = true;
        let grant = store.lease_tokens(&limits, &lease).await?;
        limits.granted(grant);
    }
    if sent {
        *last_sent = now;
    } else if now.saturating_duration_since(*last_sent) >= PING_EVERY {
        store.ping().await?;
        *last_sent = now;
    }
    Ok(())
}
