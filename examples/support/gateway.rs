//! Starting a gateway in-process for the bench examples: `routes.yaml`
//! written into a directory, bound on a free port of 127.0.0.1, run until
//! the process ends.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use switchyard::server::Gateway;
use switchyard::snapshot::CompileOptions;

/// Serves `yaml` (written as `dir/routes.yaml`); its address.
pub async fn start(yaml: &str, dir: &std::path::Path) -> std::net::SocketAddr {
    let config = dir.join("routes.yaml");
    std::fs::write(&config, yaml).unwrap();
    let gw = Gateway::bind(
        &config,
        Some("127.0.0.1:0".parse().unwrap()),
        CompileOptions::default(),
    )
    .await
    .unwrap();
    let addr = gw.local_addr().unwrap();
    tokio::spawn(gw.run(std::future::pending()));
    addr
}
