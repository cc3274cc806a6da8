//! Running the real `switchyard` binary: a free port, a child process that is
//! killed when dropped, stderr captured to a file, SIGTERM and a bounded wait.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::Duration;

use crate::support::wait_blocking;

/// The binary cargo built for these tests.
pub const BIN: &str = env!("CARGO_BIN_EXE_switchyard");

/// Runs `switchyard ARGS` to completion (bounded by 20 s) with extra env vars.
pub fn run(args: &[&str], envs: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let child = cmd.spawn().expect("spawn switchyard");
    let pid = child.id();
    // Output is small: wait_with_output cannot deadlock on a full pipe here,
    // but bound the time with a watchdog thread anyway.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(Duration::from_secs(20)) {
        Ok(out) => out.expect("wait for switchyard"),
        Err(_) => {
            let _ = Command::new("kill")
                .arg("-KILL")
                .arg(pid.to_string())
                .status();
            panic!("switchyard {args:?} did not finish within 20 s");
        }
    }
}

/// A local address nobody listens on right now (bind port 0, then drop it).
pub fn free_addr() -> SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind port 0");
    l.local_addr().expect("local addr")
}

/// A `switchyard serve` child process. Killed (SIGKILL) when dropped if it is
/// still running.
pub struct Served {
    pub child: Child,
    pub addr: SocketAddr,
    pub stderr: PathBuf,
}

impl Drop for Served {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl Served {
    /// Starts `switchyard serve --config CONFIG --listen 127.0.0.1:FREE` with
    /// extra env vars, stderr to `DIR/stderr.log`, and waits (up to 10 s)
    /// until the port accepts connections.
    pub fn start(config: &Path, dir: &Path, envs: &[(&str, &str)]) -> Served {
        Self::start_with(config, dir, &[], envs)
    }

    /// As [`Served::start`], with extra arguments after `serve` (`--log-format json`).
    pub fn start_with(config: &Path, dir: &Path, args: &[&str], envs: &[(&str, &str)]) -> Served {
        let addr = free_addr();
        let stderr = dir.join("stderr.log");
        let file = std::fs::File::create(&stderr).expect("create stderr log");
        let mut cmd = Command::new(BIN);
        cmd.arg("serve")
            .arg("--config")
            .arg(config)
            .arg("--listen")
            .arg(addr.to_string())
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(file));
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("spawn switchyard serve");
        let mut served = Served {
            child,
            addr,
            stderr,
        };
        let listening = wait_blocking(Duration::from_secs(10), || {
            if let Ok(Some(status)) = served.child.try_wait() {
                panic!(
                    "switchyard serve exited early with {status}:\n{}",
                    served.log()
                );
            }
            std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
        });
        assert!(
            listening,
            "switchyard serve did not listen on {addr} within 10 s:\n{}",
            served.log()
        );
        served
    }

    /// Everything the process wrote to stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// Sends SIGTERM (via the `kill` command) and waits up to `within` for
    /// the exit status.
    pub fn terminate(&mut self, within: Duration) -> ExitStatus {
        let pid = self.child.id().to_string();
        let sent = Command::new("kill")
            .arg("-TERM")
            .arg(&pid)
            .status()
            .expect("run kill");
        assert!(sent.success(), "kill -TERM {pid} failed");
        let mut status = None;
        wait_blocking(within, || {
            status = self.child.try_wait().expect("try_wait");
            status.is_some()
        });
        status.unwrap_or_else(|| {
            panic!(
                "switchyard did not exit within {within:?} of SIGTERM:\n{}",
                self.log()
            )
        })
    }
}
