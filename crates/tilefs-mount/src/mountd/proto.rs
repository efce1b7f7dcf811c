//! The mount service's protocol: one JSON request and one JSON reply per
//! connection, each a single SOCK_SEQPACKET message of at most
//! [`MAX_MESSAGE`] bytes, with file descriptors beside it (SCM_RIGHTS,
//! at most [`MAX_FDS`]): going in, the directories the client opened
//! (`O_PATH`, no symlink followed): the mount point when the service is to
//! attach the mount, then the upper and work directories of a writable
//! mount; coming back, the detached mount when asked for.
//!
//! Requests are parsed strictly: unknown fields, missing fields and
//! oversized messages are refused.

use rustix::fd::{AsFd, OwnedFd};
use rustix::io::Errno;
use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer, SendAncillaryMessage,
    SendFlags,
};
use serde::{Deserialize, Serialize};
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::path::PathBuf;

/// Largest request or reply.
pub const MAX_MESSAGE: usize = 16 * 1024;
/// Most descriptors with a message (more are closed unread).
pub const MAX_FDS: usize = 3;

#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "op", rename_all = "lowercase", deny_unknown_fields)]
pub enum Request {
    /// Mount the tagged image `image` of `store`. With `attach`, at the
    /// directory whose descriptor comes first with the request; otherwise
    /// the detached mount comes back (for a client in its own mount
    /// namespace). With `upper`, writable: the upper and work directories'
    /// descriptors come next.
    Mount {
        store: PathBuf,
        image: String,
        attach: bool,
        #[serde(default)]
        noexec: bool,
        #[serde(default)]
        nosymfollow: bool,
        #[serde(default)]
        verity: Option<String>,
        #[serde(default)]
        upper: bool,
    },
    /// Unmount the mount whose root comes with the request (one the service
    /// made for this caller).
    Umount {
        #[serde(default)]
        lazy: bool,
    },
}

#[derive(Debug, Serialize, Deserialize, PartialEq, Eq, Default)]
#[serde(deny_unknown_fields)]
pub struct Reply {
    pub ok: bool,
    #[serde(default)]
    pub error: Option<String>,
    #[serde(default)]
    pub notices: Vec<String>,
    /// Refused for want of room (too many requests, descriptors): worth
    /// trying again shortly.
    #[serde(default)]
    pub busy: bool,
}

impl Reply {
    pub fn default_ok() -> Reply {
        Reply {
            ok: true,
            ..Reply::default()
        }
    }

    pub fn error(e: impl Into<String>) -> Reply {
        Reply {
            ok: false,
            error: Some(e.into()),
            ..Reply::default()
        }
    }

    pub fn busy(e: impl Into<String>) -> Reply {
        Reply {
            busy: true,
            ..Reply::error(e)
        }
    }
}

impl Request {
    /// Parses a request, strictly.
    pub fn parse(bytes: &[u8]) -> Result<Request, String> {
        if bytes.len() > MAX_MESSAGE {
            return Err(format!("request of {} bytes (at most {MAX_MESSAGE})", bytes.len()));
        }
        serde_json::from_slice(bytes).map_err(|e| format!("malformed request: {e}"))
    }
}

/// Sends one message, with `fds` beside it.
pub fn send(sock: impl AsFd, msg: &[u8], fds: &[OwnedFd]) -> Result<(), Errno> {
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(8))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds: Vec<_> = fds.iter().take(8).map(|f| f.as_fd()).collect();
    if !fds.is_empty() {
        control.push(SendAncillaryMessage::ScmRights(&fds));
    }
    loop {
        match sendmsg(&sock, &[IoSlice::new(msg)], &mut control, SendFlags::NOSIGNAL) {
            Err(Errno::INTR) => continue,
            Err(e) => return Err(e),
            Ok(_) => return Ok(()),
        }
    }
}

/// Receives one message and the descriptors with it (at most
/// [`MAX_FDS`]; more are closed). A message longer than [`MAX_MESSAGE`] is
/// an error (EMSGSIZE).
pub fn recv(sock: impl AsFd) -> Result<(Vec<u8>, Vec<OwnedFd>), Errno> {
    recv_at_most(sock, MAX_FDS)
}

/// [`recv`], keeping up to `max_fds` descriptors (at most 8).
pub fn recv_at_most(sock: impl AsFd, max_fds: usize) -> Result<(Vec<u8>, Vec<OwnedFd>), Errno> {
    let max_fds = max_fds.min(8);
    let mut buf = vec![0u8; MAX_MESSAGE + 1];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(9))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut reset = false;
    let got = loop {
        match recvmsg(
            &sock,
            &mut [IoSliceMut::new(&mut buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Err(Errno::INTR) => continue,
            // A peer that closed without reading what we sent resets the
            // connection, but what it sent before is still queued: the
            // service answers a refused caller before reading its request.
            Err(Errno::CONNRESET) if !reset => reset = true,
            Ok(r) if reset && r.bytes == 0 => return Err(Errno::CONNRESET),
            r => break r?,
        }
    };
    let mut fds = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(got) = m {
            fds.extend(got);
        }
    }
    fds.truncate(max_fds);
    if got.bytes > MAX_MESSAGE || got.flags.contains(rustix::net::ReturnFlags::TRUNC) {
        return Err(Errno::MSGSIZE);
    }
    // Descriptors sent but not received: this process had no room for
    // them (or more than 8 came).
    if got.flags.contains(rustix::net::ReturnFlags::CTRUNC) {
        return Err(Errno::MFILE);
    }
    buf.truncate(got.bytes);
    Ok((buf, fds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strict_parsing() {
        let ok = br#"{"op":"mount","store":"/s","image":"a:1","attach":true}"#;
        assert_eq!(
            Request::parse(ok).unwrap(),
            Request::Mount {
                store: "/s".into(),
                image: "a:1".into(),
                attach: true,
                noexec: false,
                nosymfollow: false,
                verity: None,
                upper: false
            }
        );
        assert_eq!(
            Request::parse(br#"{"op":"umount"}"#).unwrap(),
            Request::Umount { lazy: false }
        );
        for bad in [
            &br#"{"op":"mount","store":"/s","image":"a","attach":true,"uid":0}"#[..],
            br#"{"op":"mount","store":"/s"}"#,
            br#"{"op":"format"}"#,
            br#"{"op":"umount"} x"#,
            b"",
            b"\xff\xfe",
            br#"[1,2]"#,
        ] {
            assert!(Request::parse(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        assert!(Request::parse(&vec![b' '; MAX_MESSAGE + 1]).is_err());
    }

    /// Hostile bytes: random, and valid requests cut or flipped anywhere,
    /// give a request or an error, never a panic.
    #[test]
    fn hostile_inputs() {
        let valid = br#"{"op":"mount","store":"/var/lib/tilefs/store","image":"os:1","attach":false,"noexec":true,"verity":"require"}"#;
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..20_000 {
            let mut b = valid.to_vec();
            match next() % 3 {
                0 => b.truncate((next() % b.len() as u64) as usize),
                1 => {
                    let i = (next() % b.len() as u64) as usize;
                    b[i] = next() as u8;
                }
                _ => b = (0..next() % 64).map(|_| next() as u8).collect(),
            }
            let _ = Request::parse(&b);
        }
    }
}
