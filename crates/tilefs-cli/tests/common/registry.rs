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
    /// The client's User-Agent.
    pub agent: String,
}

/// Writes an auth.json at `path` (as `podman login` does) giving
/// `user_pass` (`USER:PASSWORD`) for each of `registries`.
pub fn write_auth(path: &std::path::Path, registries: &[&str], user_pass: &str) {
    use base64::Engine;
    let entry = serde_json::json!({"auth": base64::engine::general_purpose::STANDARD.encode(user_pass)});
    let auths: serde_json::Map<String, serde_json::Value> =
        registries.iter().map(|r| (r.to_string(), entry.clone())).collect();
    fs::write(path, serde_json::json!({ "auths": auths }).to_string()).unwrap();
}

impl Registry {
    pub fn start(area: &Area) -> Registry {
        Registry::start_with(area, "")
    }

    /// `extra`: more of the registry's configuration (an `auth:` section).
    pub fn start_with(area: &Area, extra: &str) -> Registry {
        Registry::start_named(area, "registry", extra)
    }

    /// One that asks for `user`'s `password` (htpasswd, bcrypt), and an
    /// auth.json at `auth` holding them for it (as `podman login` writes).
    pub fn start_with_password(area: &Area, user: &str, password: &str, auth: &std::path::Path) -> Registry {
        Registry::start_named_with_password(area, "registry", user, password, auth)
    }

    /// [`Registry::start_with_password`], one of several in `area`.
    pub fn start_named_with_password(
        area: &Area,
        name: &str,
        user: &str,
        password: &str,
        auth: &std::path::Path,
    ) -> Registry {
        let htpasswd = area.path(&format!("{name}.htpasswd"));
        let out = Command::new("htpasswd")
            .args(["-Bbn", user, password])
            .output()
            .expect("htpasswd (apache2-utils; scripts/setup installs it)");
        assert!(out.status.success());
        fs::write(&htpasswd, &out.stdout).unwrap();
        let r = Registry::start_named(
            area,
            name,
            &format!(
                "auth:\n  htpasswd:\n    realm: tilefs-test\n    path: {}\n",
                htpasswd.display()
            ),
        );
        write_auth(auth, &[&r.addr], &format!("{user}:{password}"));
        r
    }

    /// One of several in `area`, in its directory `name`.
    pub fn start_named(area: &Area, name: &str, extra: &str) -> Registry {
        let root = area.dir(name);
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
                let q: Vec<&str> = l.split('"').collect();
                let req = q.get(1)?;
                let mut rest = q.get(2)?.split_whitespace();
                let status = rest.next()?.parse().ok()?;
                let bytes = rest.next()?.parse().unwrap_or(0);
                let mut parts = req.split_whitespace();
                Some(Request {
                    method: parts.next()?.to_string(),
                    path: parts.next()?.to_string(),
                    status,
                    bytes,
                    agent: q.get(5).unwrap_or(&"").to_string(),
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

    /// The digest of each blob uploaded (the PUT that ends an upload)
    /// since `before` requests, in the log's order.
    pub fn uploaded_since(&self, before: usize) -> Vec<String> {
        self.requests()[before..]
            .iter()
            .filter(|q| q.method == "PUT" && q.path.contains("/blobs/uploads/"))
            .filter_map(|q| {
                let d = q.path.split("digest=").nth(1)?;
                Some(d.split('&').next()?.replace("%3A", ":").replace("%3a", ":"))
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

/// What a [`Relay`] answers a request with.
pub enum Answer {
    /// Forward it to the upstream server (its answer passes as `pass`
    /// says).
    Forward,
    /// 200 with this media type and a body that never ends (until the
    /// client goes or the relay is dropped).
    Endless(&'static str),
    /// 200 stating `len` bytes, sent `per_second` bytes a second.
    Drip { len: u64, per_second: u64 },
    /// 302 to this location.
    Redirect(String),
    /// 200 with this media type and body.
    Body(&'static str, Vec<u8>),
    /// Nothing: the connection is held open.
    Stall,
    /// 401 with this `WWW-Authenticate` challenge.
    Challenge(String),
}

impl Registry {
    /// Uploads `data` as a blob of `repo` with curl (a session, then one
    /// PUT): its digest and size.
    pub fn upload_blob(&self, repo: &str, data: &[u8]) -> (String, usize) {
        let digest = format!("sha256:{}", super::sha256_hex(data));
        let out = Command::new("curl")
            .args(["-sf", "-D", "-", "-o", "/dev/null", "-X", "POST"])
            .arg(format!("http://{}/v2/{repo}/blobs/uploads/", self.addr))
            .output()
            .unwrap();
        assert!(out.status.success());
        let headers = String::from_utf8_lossy(&out.stdout);
        let location = headers
            .lines()
            .find_map(|l| l.strip_prefix("Location: ").or_else(|| l.strip_prefix("location: ")))
            .unwrap()
            .trim()
            .to_string();
        let sep = if location.contains('?') { '&' } else { '?' };
        let url = match location.starts_with("http") {
            true => format!("{location}{sep}digest={digest}"),
            false => format!("http://{}{location}{sep}digest={digest}", self.addr),
        };
        curl_put(&url, "application/octet-stream", data, "PUT");
        (digest, data.len())
    }
}

/// PUTs (or POSTs) `data` to `url` with curl, which must succeed.
pub fn curl_put(url: &str, content_type: &str, data: &[u8], method: &str) {
    let mut child = Command::new("curl")
        .args(["-sf", "-X", method, "-H"])
        .arg(format!("Content-Type: {content_type}"))
        .args(["--data-binary", "@-", url])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(data).unwrap();
    assert!(child.wait().unwrap().success(), "{method} {url}");
}

/// Forwards 127.0.0.1 connections to `upstream`: requests as they come,
/// and each chunk of the answers as `pass(chunk, stopping)` says (which
/// may also rewrite the chunk's bytes, as a corrupting proxy would).
/// Stopped when dropped.
pub struct Relay {
    pub addr: String,
    stop: Arc<AtomicBool>,
}

/// How a [`Relay`] answers a request: by its method and path.
type Answering = Arc<dyn Fn(&str, &str) -> Answer + Send + Sync>;

impl Relay {
    pub fn start(upstream: &str, pass: impl Fn(&mut [u8], &AtomicBool) -> Pass + Send + Sync + 'static) -> Relay {
        Relay::spawn(upstream, None, pass)
    }

    /// A relay that answers requests itself as `answer(method, path)`
    /// says (a hostile registry in front of a real one), forwarding the
    /// others whole.
    pub fn answering(upstream: &str, answer: impl Fn(&str, &str) -> Answer + Send + Sync + 'static) -> Relay {
        Relay::spawn(upstream, Some(Arc::new(answer)), |_, _| Pass::All)
    }

    fn spawn(
        upstream: &str,
        answer: Option<Answering>,
        pass: impl Fn(&mut [u8], &AtomicBool) -> Pass + Send + Sync + 'static,
    ) -> Relay {
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
                let (answer, stop) = (answer.clone(), stop2.clone());
                std::thread::spawn(move || match answer {
                    None => {
                        let _ = std::io::copy(&mut { c2 }, &mut { s2 });
                    }
                    Some(answer) => requests(c2, s2, &*answer, &stop),
                });
                let (stop, pass) = (stop2.clone(), pass.clone());
                std::thread::spawn(move || {
                    let (mut client, mut server) = (client, server);
                    let mut buf = [0u8; 16 << 10];
                    while let Ok(n @ 1..) = server.read(&mut buf) {
                        let (k, end) = match pass(&mut buf[..n], &stop) {
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

/// The requests of one connection: each answered as `answer` says, or
/// forwarded to `server` (a request with a body of unstated length ends
/// the inspection: the rest is forwarded as it comes).
fn requests(client: TcpStream, mut server: TcpStream, answer: &dyn Fn(&str, &str) -> Answer, stop: &AtomicBool) {
    use std::io::BufRead;
    let mut out = client.try_clone().unwrap();
    let mut reader = std::io::BufReader::new(client);
    loop {
        let mut head = Vec::new();
        loop {
            let mut line = Vec::new();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            head.extend_from_slice(&line);
            if line == b"\r\n" || line == b"\n" {
                break;
            }
        }
        let text = String::from_utf8_lossy(&head).into_owned();
        let mut first = text.split_whitespace();
        let (method, path) = (first.next().unwrap_or(""), first.next().unwrap_or(""));
        let header = |name: &str| {
            text.lines().find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.trim().eq_ignore_ascii_case(name).then(|| v.trim().to_string())
            })
        };
        let reply = match answer(method, path) {
            Answer::Forward => {
                if server.write_all(&head).is_err() {
                    return;
                }
                if header("transfer-encoding").is_some() {
                    let _ = std::io::copy(&mut reader, &mut server);
                    return;
                }
                let len: u64 = header("content-length").and_then(|l| l.parse().ok()).unwrap_or(0);
                if std::io::copy(&mut (&mut reader).take(len), &mut server).is_err() {
                    return;
                }
                continue;
            }
            a => a,
        };
        let _ = respond(&mut out, reply, stop);
        let _ = out.shutdown(std::net::Shutdown::Both);
        let _ = server.shutdown(std::net::Shutdown::Both);
        return;
    }
}

/// Writes a relay's own answer.
fn respond(out: &mut TcpStream, answer: Answer, stop: &AtomicBool) -> std::io::Result<()> {
    match answer {
        Answer::Forward => unreachable!("forwarded, not answered"),
        Answer::Endless(media_type) => {
            out.write_all(
                format!("HTTP/1.1 200 OK\r\nContent-Type: {media_type}\r\nConnection: close\r\n\r\n").as_bytes(),
            )?;
            let chunk = [b' '; 64 << 10];
            while !stop.load(Relaxed) {
                out.write_all(&chunk)?;
            }
        }
        Answer::Drip { len, per_second } => {
            out.write_all(format!("HTTP/1.1 200 OK\r\nContent-Length: {len}\r\n\r\n").as_bytes())?;
            let mut left = len;
            while left > 0 {
                let until = Instant::now() + Duration::from_secs(1);
                while Instant::now() < until {
                    if stop.load(Relaxed) {
                        return Ok(());
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                let n = per_second.min(left);
                out.write_all(&vec![b'x'; n as usize])?;
                left -= n;
            }
        }
        Answer::Redirect(to) => {
            out.write_all(format!("HTTP/1.1 302 Found\r\nLocation: {to}\r\nContent-Length: 0\r\n\r\n").as_bytes())?;
        }
        Answer::Body(media_type, body) => {
            out.write_all(
                format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: {media_type}\r\nContent-Length: {}\r\n\r\n",
                    body.len()
                )
                .as_bytes(),
            )?;
            out.write_all(&body)?;
        }
        Answer::Stall => {
            while !stop.load(Relaxed) {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Answer::Challenge(challenge) => {
            out.write_all(
                format!("HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: {challenge}\r\nContent-Length: 0\r\n\r\n")
                    .as_bytes(),
            )?;
        }
    }
    Ok(())
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

/// A registry with the OCI referrers API (Debian's docker-registry lacks
/// it): go-containerregistry's, in memory, built by
/// `tests/referrers-registry/build.sh` (scripts/setup runs it). Its access
/// log is "METHOD PATH STATUS BYTES" lines. Stopped when dropped.
pub struct ReferrersRegistry {
    child: Child,
    pub addr: String,
    log: PathBuf,
}

impl ReferrersRegistry {
    /// None only when Go is not installed (said on stderr).
    pub fn start(area: &Area) -> Option<ReferrersRegistry> {
        let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/referrers-registry/build.sh");
        let out = Command::new("bash").arg(&script).output().unwrap();
        let dir = match out.status.code() {
            Some(0) => PathBuf::from(String::from_utf8(out.stdout).unwrap().trim()),
            Some(3) => {
                eprintln!("skipping: Go is not installed, so referrers-registry cannot be built");
                return None;
            }
            _ => panic!(
                "building referrers-registry failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ),
        };
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let addr = format!("127.0.0.1:{port}");
        let log = area.path("referrers-registry.log");
        let child = Command::new(dir.join("referrers-registry"))
            .args(["-addr", &addr, "-log"])
            .arg(&log)
            .spawn()
            .unwrap();
        let r = ReferrersRegistry { child, addr, log };
        let t = Instant::now();
        while TcpStream::connect(&r.addr).is_err() {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "referrers-registry did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Some(r)
    }

    /// Every request so far (each is logged before its handler returns).
    pub fn requests(&self) -> Vec<Request> {
        fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                let [method, path, status, bytes] = f.as_slice() else {
                    return None;
                };
                Some(Request {
                    method: method.to_string(),
                    path: path.to_string(),
                    status: status.parse().ok()?,
                    bytes: bytes.parse().ok()?,
                    agent: String::new(),
                })
            })
            .collect()
    }
}

impl Drop for ReferrersRegistry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A token server for a docker-registry started with [`TokenServer::auth`]
/// (the distribution spec's token authentication): it hands out JWTs
/// signed with a key of its own (made with openssl), which the registry
/// checks against its certificate, for a user name and password (a GET
/// with Basic credentials, as skopeo asks) or an OAuth2 refresh token (a
/// POST of the refresh-token grant). Each request's method and decoded
/// parameters are logged. Stopped when dropped.
pub struct TokenServer {
    pub addr: String,
    cert: PathBuf,
    pub asked: Arc<std::sync::Mutex<Vec<Asked>>>,
    stop: Arc<AtomicBool>,
}

/// A request to a [`TokenServer`]: its method and its parameters (query
/// and form, decoded).
pub type Asked = (String, Vec<(String, String)>);

/// `application/x-www-form-urlencoded` (or a query) decoded.
fn form_pairs(s: &str) -> Vec<(String, String)> {
    let decode = |v: &str| {
        let b = v.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < b.len() {
            match b[i] {
                b'+' => out.push(b' '),
                b'%' if i + 2 < b.len() => {
                    let hex = std::str::from_utf8(&b[i + 1..i + 3]).unwrap_or("");
                    out.push(u8::from_str_radix(hex, 16).unwrap_or(b'?'));
                    i += 2;
                }
                c => out.push(c),
            }
            i += 1;
        }
        String::from_utf8_lossy(&out).into_owned()
    };
    s.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

impl TokenServer {
    pub const SERVICE: &'static str = "tilefs-test";
    const ISSUER: &'static str = "tilefs-test-issuer";

    /// A server that accepts `user`:`password` and the refresh token
    /// `refresh`.
    pub fn start(area: &Area, user: &str, password: &str, refresh: &str) -> TokenServer {
        let (key, cert) = (area.path("token-key.pem"), area.path("token-cert.pem"));
        let ok = Command::new("openssl")
            .args([
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "1",
                "-subj",
                "/CN=tilefs-test-token",
            ])
            .arg("-keyout")
            .arg(&key)
            .arg("-out")
            .arg(&cert)
            .output()
            .expect("openssl");
        assert!(
            ok.status.success(),
            "openssl req: {}",
            String::from_utf8_lossy(&ok.stderr)
        );
        let der = Command::new("openssl")
            .args(["x509", "-outform", "DER", "-in"])
            .arg(&cert)
            .output()
            .unwrap()
            .stdout;
        use base64::Engine;
        let (std64, url64) = (
            base64::engine::general_purpose::STANDARD,
            base64::engine::general_purpose::URL_SAFE_NO_PAD,
        );
        let header =
            url64.encode(serde_json::json!({"typ": "JWT", "alg": "RS256", "x5c": [std64.encode(der)]}).to_string());
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let stop = Arc::new(AtomicBool::new(false));
        let asked = Arc::new(std::sync::Mutex::new(Vec::new()));
        let basic = format!("Basic {}", std64.encode(format!("{user}:{password}")));
        let refresh = refresh.to_string();
        let (stop2, asked2) = (stop.clone(), asked.clone());
        let sign = move |scopes: &[String]| -> String {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs();
            let access: Vec<serde_json::Value> = scopes
                .iter()
                .filter_map(|s| {
                    let mut p = s.splitn(3, ':');
                    let (kind, name, actions) = (p.next()?, p.next()?, p.next()?);
                    Some(serde_json::json!({"type": kind, "name": name, "actions": actions.split(',').collect::<Vec<_>>()}))
                })
                .collect();
            let claims = serde_json::json!({
                "iss": Self::ISSUER, "sub": "alice", "aud": Self::SERVICE, "exp": now + 600,
                "nbf": now - 60, "iat": now - 60, "jti": format!("{now}-{}", access.len()), "access": access,
            });
            let signed = format!("{header}.{}", url64.encode(claims.to_string()));
            let mut child = Command::new("openssl")
                .args(["dgst", "-sha256", "-sign"])
                .arg(&key)
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            child.stdin.take().unwrap().write_all(signed.as_bytes()).unwrap();
            let sig = child.wait_with_output().unwrap().stdout;
            format!("{signed}.{}", url64.encode(sig))
        };
        std::thread::spawn(move || {
            while !stop2.load(Relaxed) {
                let Ok((mut conn, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                conn.set_nonblocking(false).unwrap();
                conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                let mut reader = std::io::BufReader::new(conn.try_clone().unwrap());
                let mut head = String::new();
                loop {
                    let mut line = String::new();
                    use std::io::BufRead;
                    match reader.read_line(&mut line) {
                        Ok(1..) if line != "\r\n" => head.push_str(&line),
                        _ => break,
                    }
                }
                let header = |name: &str| {
                    head.lines().find_map(|l| {
                        let (k, v) = l.split_once(':')?;
                        k.trim().eq_ignore_ascii_case(name).then(|| v.trim().to_string())
                    })
                };
                let mut first = head.split_whitespace();
                let (method, path) = (first.next().unwrap_or("").to_string(), first.next().unwrap_or(""));
                let len: usize = header("content-length").and_then(|l| l.parse().ok()).unwrap_or(0);
                let mut body = vec![0; len.min(1 << 20)];
                let _ = reader.read_exact(&mut body);
                let mut params = form_pairs(path.split_once('?').map_or("", |(_, q)| q));
                params.extend(form_pairs(&String::from_utf8_lossy(&body)));
                let param = |k: &str| params.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
                let scopes: Vec<String> = params
                    .iter()
                    .filter(|(k, _)| k == "scope")
                    .flat_map(|(_, v)| v.split(' ').map(str::to_string).collect::<Vec<_>>())
                    .collect();
                let granted = match method.as_str() {
                    "GET" => header("authorization").as_deref() == Some(basic.as_str()),
                    "POST" => {
                        param("grant_type").as_deref() == Some("refresh_token")
                            && param("refresh_token").as_deref() == Some(refresh.as_str())
                    }
                    _ => false,
                };
                asked2.lock().unwrap().push((method, params.clone()));
                let answer = match granted {
                    true => {
                        let body = serde_json::json!({"access_token": sign(&scopes), "expires_in": 600}).to_string();
                        format!(
                            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                            body.len()
                        )
                    }
                    false => "HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\nContent-Length: 26\r\nConnection: close\r\n\r\n{\"error\":\"invalid_grant\"}\n"
                        .to_string(),
                };
                let _ = conn.write_all(answer.as_bytes());
            }
        });
        TokenServer {
            addr,
            cert,
            asked,
            stop,
        }
    }

    /// The registry configuration (for [`Registry::start_with`]) that
    /// sends clients here.
    pub fn auth(&self) -> String {
        format!(
            "auth:\n  token:\n    realm: http://{}/token\n    service: {}\n    issuer: {}\n    rootcertbundle: {}\n",
            self.addr,
            Self::SERVICE,
            Self::ISSUER,
            self.cert.display()
        )
    }
}

impl Drop for TokenServer {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
    }
}
