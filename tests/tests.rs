//! One integration test binary: the real gateway, in-process, against fake
//! upstreams on 127.0.0.1.

mod support;

mod failover;
mod streaming;
