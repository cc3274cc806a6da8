//! A real `redis-server` for the shared-state tests: started on a free
//! loopback port in its own temp directory, without persistence, and
//! stopped when dropped. `.ci/run` installs Debian's `redis-server`; a
//! machine without it fails these tests, saying so.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::wait_blocking;

/// A running (or killed, to be restarted) `redis-server`.
pub struct RedisServer {
    pub port: u16,
    dir: tempfile::TempDir,
    password: Option<String>,
    child: Option<Child>,
}

impl RedisServer {
    /// Starts a server on a free port; panics if it does not answer within 5 s.
    pub fn start() -> RedisServer {
        Self::start_with(None)
    }

    /// Starts a server that requires `password`.
    pub fn start_with(password: Option<&str>) -> RedisServer {
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut server = RedisServer {
            port,
            dir: tempfile::tempdir().unwrap(),
            password: password.map(str::to_owned),
            child: None,
        };
        server.restart();
        server
    }

    /// (Re)starts the server on its port (empty: nothing was persisted).
    pub fn restart(&mut self) {
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some(pw) = &self.password {
            cmd.args(["--requirepass", pw]);
        }
        let child = cmd.spawn().unwrap_or_else(|e| {
            panic!("cannot start redis-server ({e}): install it (Debian: apt-get install redis-server; .ci/run does)")
        });
        self.child = Some(child);
        let port = self.port;
        assert!(
            wait_blocking(Duration::from_secs(5), || answers(port)),
            "redis-server on port {port} did not answer within 5 s"
        );
    }

    /// Kills the server at once (SIGKILL), as a crashed pod would go.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Freezes (`SIGSTOP`) or thaws (`SIGCONT`) the server: connected, but
    /// answering nothing, as a store too slow for its timeout.
    pub fn freeze(&self, frozen: bool) {
        let pid = self.child.as_ref().expect("running").id().to_string();
        let signal = if frozen { "-STOP" } else { "-CONT" };
        let status = Command::new("kill").args([signal, &pid]).status().unwrap();
        assert!(status.success(), "kill {signal} {pid}");
    }

    /// `redis://[:password@]127.0.0.1:port/0`.
    pub fn url(&self) -> String {
        match &self.password {
            Some(pw) => format!("redis://:{pw}@127.0.0.1:{}/0", self.port),
            None => format!("redis://127.0.0.1:{}/0", self.port),
        }
    }

    /// A file holding [`RedisServer::url`], as a mounted Secret would.
    pub fn url_file(&self) -> PathBuf {
        let path = self.dir.path().join("redis-url");
        std::fs::write(&path, format!("{}\n", self.url())).unwrap();
        path
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if self.child.is_some() {
            self.freeze(false);
        }
        self.kill();
    }
}

/// Whether something on `port` answers `PING` (or asks for a password).
fn answers(port: u16) -> bool {
    let Ok(mut s) = TcpStream::connect((Ipv4Addr::LOCALHOST, port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    if s.write_all(b"PING\r\n").is_err() {
        return false;
    }
    let mut buf = [0u8; 64];
    match s.read(&mut buf) {
        Ok(n) => buf[..n].starts_with(b"+PONG") || buf[..n].starts_with(b"-NOAUTH"),
        Err(_) => false,
    }
}
