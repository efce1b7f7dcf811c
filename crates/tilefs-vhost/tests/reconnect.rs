//! The VMM's side: a VMM that connects, negotiates and goes away (or
//! dies mid-message) leaves the server serving the next one; with `once`,
//! the server returns after the first.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tilefs_vhost::fuzzing::Echo;
use tilefs_vhost::{serve, Options};
use vhost::vhost_user::message::{VhostUserConfigFlags, VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::VhostBackend;

fn wait_for(p: &std::path::Path) {
    let end = Instant::now() + Duration::from_secs(10);
    while !p.exists() {
        assert!(Instant::now() < end, "no socket");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Connects as a VMM does (retrying while the server sets up its next
/// listener) and asks what a VMM asks first.
fn negotiate(sock: &std::path::Path) -> (u64, Vec<u8>) {
    let end = Instant::now() + Duration::from_secs(10);
    let mut f = loop {
        match Frontend::connect(sock, 2) {
            Ok(f) => break f,
            Err(e) => {
                assert!(Instant::now() < end, "cannot connect: {e}");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    };
    f.set_owner().unwrap();
    let features = f.get_features().unwrap();
    assert!(features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0);
    f.set_features(features).unwrap();
    let pf = f.get_protocol_features().unwrap();
    assert!(pf.contains(VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::MQ));
    f.set_protocol_features(pf).unwrap();
    assert_eq!(f.get_queue_num().unwrap(), 2);
    let (_, cfg) = f.get_config(0, 44, VhostUserConfigFlags::WRITABLE, &[0u8; 44]).unwrap();
    (features, cfg)
}

#[test]
fn the_next_vmm_is_served_after_one_goes_away() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("fs.sock");
    let opts = Options {
        socket: sock.clone(),
        tag: Some("myfs".into()),
        request_queues: 1,
        threads: 2,
        once: false,
        socket_group: None,
    };
    std::thread::spawn(move || serve(Arc::new(Echo), &opts));
    wait_for(&sock);
    for round in 0..3 {
        let (_, cfg) = negotiate(&sock);
        assert_eq!(&cfg[..4], b"myfs", "round {round}");
        assert_eq!(u32::from_le_bytes(cfg[36..40].try_into().unwrap()), 1);
        // A VMM that dies in the middle of a message.
        let mut s = loop {
            if let Ok(s) = UnixStream::connect(&sock) {
                break s;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        s.write_all(&[1, 0, 0, 0, 1]).unwrap();
        drop(s);
        // Garbage: a header announcing a huge payload.
        let mut s = loop {
            if let Ok(s) = UnixStream::connect(&sock) {
                break s;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let _ = s.write_all(&[0xff; 64]);
        drop(s);
    }
}

#[test]
fn once_returns_when_the_vmm_goes_away() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("fs.sock");
    let opts = Options {
        socket: sock.clone(),
        tag: Some("myfs".into()),
        request_queues: 1,
        threads: 2,
        once: true,
        socket_group: None,
    };
    let t = std::thread::spawn(move || serve(Arc::new(Echo), &opts));
    wait_for(&sock);
    negotiate(&sock);
    let end = Instant::now() + Duration::from_secs(10);
    while !t.is_finished() {
        assert!(Instant::now() < end, "serve did not return");
        std::thread::sleep(Duration::from_millis(20));
    }
    t.join().unwrap().unwrap();
}
