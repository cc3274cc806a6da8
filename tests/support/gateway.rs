//! The gateway under test, in-process on port 0 against a routes.yaml in a
//! temp dir.

use std::net::SocketAddr;
use std::path::PathBuf;

use switchyard::server::Gateway;
use switchyard::snapshot::CompileOptions;
use tokio::sync::oneshot;

use super::get;

/// A running gateway; stops when dropped.
pub struct Gw {
    pub addr: SocketAddr,
    /// The admin listener, when the config has `admin_listen`.
    pub admin: Option<SocketAddr>,
    pub dir: tempfile::TempDir,
    pub config: PathBuf,
    stop: Option<oneshot::Sender<()>>,
    pub app: std::sync::Arc<switchyard::state::App>,
}

impl Drop for Gw {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}

impl Gw {
    /// Rewrites routes.yaml atomically (write a temp file, rename over), as editors do.
    pub fn rewrite(&self, yaml: &str) {
        let tmp = self.dir.path().join(".routes.yaml.tmp");
        std::fs::write(&tmp, yaml).unwrap();
        std::fs::rename(&tmp, &self.config).unwrap();
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

/// Starts the gateway on `yaml`.
pub async fn gateway(yaml: &str) -> Gw {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("routes.yaml");
    std::fs::write(&config, yaml).unwrap();
    let gw = Gateway::bind(
        &config,
        Some("127.0.0.1:0".parse().unwrap()),
        CompileOptions::default(),
    )
    .await
    .unwrap_or_else(|e| panic!("gateway did not start:\n{e}"));
    let addr = gw.local_addr().unwrap();
    let admin = gw.admin_addr();
    let app = gw.app();
    let (tx, rx) = oneshot::channel();
    tokio::spawn(gw.run(async {
        let _ = rx.await;
    }));
    // `run` starts the config watcher and the prober before it accepts: once
    // /healthz answers, both are running (a rewrite before that goes unseen).
    let up = get(addr, "/healthz").await;
    assert_eq!(up.status, 200, "{}", up.text());
    Gw {
        addr,
        admin,
        dir,
        config,
        stop: Some(tx),
        app,
    }
}
