//! A real registry on loopback for tests: Debian's docker-registry (the
//! CNCF distribution server), plain HTTP on a free 127.0.0.1 port, storage
//! in the test's temporary directory, its access log read back to count
//! what went over the wire.

use super::Area;
use std::fs;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The registry server; stopped when dropped.
pub struct Registry {
    child: Option<Child>,
    pub addr: String,
    pub root: PathBuf,
    log: PathBuf,
    config: PathBuf,
}

/// One line of the access log.
#[derive(Debug, Clone)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub status: u16,
    pub bytes: u64,
}

impl Registry {
    pub fn start(area: &Area) -> Registry {
        Registry::start_with(area, "")
    }

    /// `extra`: more of the registry's configuration (an `auth:` section).
    pub fn start_with(area: &Area, extra: &str) -> Registry {
        let root = area.dir("registry");
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let addr = format!("127.0.0.1:{port}");
        let config = root.join("config.yml");
        fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: false\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: {addr}\n{extra}",
                root.join("data").display()
            ),
        )
        .unwrap();
        let log = root.join("log");
        let mut r = Registry {
            child: None,
            addr,
            root,
            log,
            config,
        };
        r.run();
        r
    }

    fn run(&mut self) {
        let child = Command::new("docker-registry")
            .arg("serve")
            .arg(&self.config)
            .stdout(
                fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&self.log)
                    .unwrap(),
            )
            .stderr(
                fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(self.root.join("stderr"))
                    .unwrap(),
            )
            .spawn()
            .expect("docker-registry (scripts/setup installs it)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(&self.addr).is_err() {
            assert!(Instant::now() < deadline, "the registry did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops the server (its storage stays).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same port and storage.
    pub fn restart(&mut self) {
        self.stop();
        self.run();
    }

    /// Every request logged so far. The registry logs a request after it
    /// has sent the response, so a client may be done before its line is
    /// written: wait until the logs have stopped growing for 100 ms.
    pub fn requests(&self) -> Vec<Request> {
        let size = || {
            [self.log.clone(), self.root.join("stderr")]
                .iter()
                .map(|p| fs::metadata(p).map_or(0, |m| m.len()))
                .sum::<u64>()
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut last = size();
        loop {
            std::thread::sleep(Duration::from_millis(100));
            let now = size();
            if now == last || Instant::now() > deadline {
                break;
            }
            last = now;
        }
        let log = fs::read_to_string(&self.log).unwrap_or_default()
            + &fs::read_to_string(self.root.join("stderr")).unwrap_or_default();
        log.lines()
            .filter_map(|l| {
                let mut q = l.split('"');
                let req = q.nth(1)?;
                let mut rest = q.next()?.split_whitespace();
                let status = rest.next()?.parse().ok()?;
                let bytes = rest.next()?.parse().unwrap_or(0);
                let mut parts = req.split_whitespace();
                Some(Request {
                    method: parts.next()?.to_string(),
                    path: parts.next()?.to_string(),
                    status,
                    bytes,
                })
            })
            .collect()
    }

    /// Bytes of blobs the registry sent, from its access log.
    pub fn blob_bytes_sent(&self) -> u64 {
        self.requests()
            .iter()
            .filter(|r| r.method == "GET" && r.path.contains("/blobs/"))
            .map(|r| r.bytes)
            .sum()
    }

    /// The digest of each blob the registry sent (a GET it answered with
    /// its bytes, 200 or 206), once per such GET, in the log's order: a
    /// lazy pull shows here which layers went over the wire.
    pub fn blobs_sent(&self) -> Vec<String> {
        self.requests()
            .iter()
            .filter(|r| r.method == "GET" && matches!(r.status, 200 | 206))
            .filter_map(|r| {
                let (_, rest) = r.path.split_once("/blobs/")?;
                let digest = rest.split('?').next()?;
                // Upload sessions share the prefix (/blobs/uploads/).
                digest.starts_with("sha256:").then(|| digest.to_string())
            })
            .collect()
    }

    /// Where the registry keeps blob `digest` ("sha256:HEX").
    pub fn blob_file(&self, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").unwrap();
        self.root
            .join("data/docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }
}

impl Registry {
    /// Flips a byte in the middle of the largest blob where the registry
    /// keeps it (same size, so it serves wrong bytes): returns its digest.
    pub fn tamper_largest_blob(&self) -> String {
        let blobs = self.root.join("data/docker/registry/v2/blobs/sha256");
        let mut biggest: Option<(u64, PathBuf)> = None;
        for fan in fs::read_dir(&blobs).unwrap() {
            for b in fs::read_dir(fan.unwrap().path()).unwrap() {
                let data = b.unwrap().path().join("data");
                let len = fs::metadata(&data).unwrap().len();
                if biggest.as_ref().is_none_or(|(l, _)| len > *l) {
                    biggest = Some((len, data));
                }
            }
        }
        let (_, data) = biggest.unwrap();
        let mut bytes = fs::read(&data).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0xff;
        fs::write(&data, &bytes).unwrap();
        format!(
            "sha256:{}",
            data.parent().unwrap().file_name().unwrap().to_string_lossy()
        )
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.stop();
    }
}

/// What a [`Relay`] does with a chunk that came from upstream.
pub enum Pass {
    /// Forward all of it.
    All,
    /// Forward its first bytes, then end the connection.
    Then(usize, End),
}

/// How a [`Relay`] ends a connection.
pub enum End {
    /// Close both sides, as a dropped link would.
    Cut,
    /// Forward nothing more but hold the connection open (until the relay
    /// is dropped), as a server that stalls would.
    Stall,
}

/// Forwards 127.0.0.1 connections to `upstream`: requests as they come,
/// and each chunk of the answers as `pass(chunk length, stopping)` says.
/// Stopped when dropped.
pub struct Relay {
    pub addr: String,
    stop: Arc<AtomicBool>,
}

impl Relay {
    pub fn start(upstream: &str, pass: impl Fn(usize, &AtomicBool) -> Pass + Send + Sync + 'static) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        listener.set_nonblocking(true).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let (upstream, stop2, pass) = (upstream.to_string(), stop.clone(), Arc::new(pass));
        std::thread::spawn(move || {
            while !stop2.load(Relaxed) {
                let Ok((client, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                client.set_nonblocking(false).unwrap();
                let Ok(server) = TcpStream::connect(&upstream) else {
                    continue;
                };
                let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut { c2 }, &mut { s2 });
                });
                let (stop, pass) = (stop2.clone(), pass.clone());
                std::thread::spawn(move || {
                    let (mut client, mut server) = (client, server);
                    let mut buf = [0u8; 16 << 10];
                    while let Ok(n @ 1..) = server.read(&mut buf) {
                        let (k, end) = match pass(n, &stop) {
                            Pass::All => (n, None),
                            Pass::Then(k, end) => (k.min(n), Some(end)),
                        };
                        if k > 0 && client.write_all(&buf[..k]).is_err() {
                            break;
                        }
                        match end {
                            None => continue,
                            Some(End::Stall) => {
                                while !stop.load(Relaxed) {
                                    std::thread::sleep(Duration::from_millis(50));
                                }
                                break;
                            }
                            Some(End::Cut) => break,
                        }
                    }
                    let _ = client.shutdown(std::net::Shutdown::Both);
                    let _ = server.shutdown(std::net::Shutdown::Both);
                });
            }
        });
        Relay { addr, stop }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
    }
}

/// A [`Relay`] to `upstream` that forwards while open; while closed,
/// nothing more goes downstream (connections stall, as behind a dead link).
pub struct Gate {
    pub addr: String,
    pub closed: Arc<AtomicBool>,
    _relay: Relay,
}

impl Gate {
    pub fn start(upstream: &str) -> Gate {
        let closed = Arc::new(AtomicBool::new(false));
        let shut = closed.clone();
        let relay = Relay::start(upstream, move |_, stop| {
            while shut.load(Relaxed) {
                if stop.load(Relaxed) {
                    return Pass::Then(0, End::Cut);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Pass::All
        });
        Gate {
            addr: relay.addr.clone(),
            closed,
            _relay: relay,
        }
    }
}
