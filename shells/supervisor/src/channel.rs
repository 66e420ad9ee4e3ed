//! The private release/watchdog channel (plan §7.4): a Unix stream socket
//! in the daemon's 0700 run directory, accepted once, its peer checked with
//! `SO_PEERCRED`. The release byte carries the child's three pipe ends as
//! `SCM_RIGHTS`, so the launcher holds no pipe before release and none of
//! them after it created the shell.

use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

/// The child's pipe ends, in stdin, stdout, stderr order.
#[derive(Debug)]
pub(crate) struct ChildEnds {
    /// Read end of the stdin pipe.
    pub stdin: OwnedFd,
    /// Write end of the stdout pipe.
    pub stdout: OwnedFd,
    /// Write end of the stderr pipe.
    pub stderr: OwnedFd,
}

/// Sends the one-byte release with the child's pipe ends.
pub(crate) fn send_release(sock: &UnixStream, ends: &ChildEnds) -> io::Result<()> {
    let fds = [ends.stdin.as_fd(), ends.stdout.as_fd(), ends.stderr.as_fd()];
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(3))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(io::Error::other("release: control buffer too small"));
    }
    let byte = [crate::frame::RELEASE];
    let sent = rustix::net::sendmsg(
        sock,
        &[IoSlice::new(&byte)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    if sent == 1 {
        Ok(())
    } else {
        Err(io::Error::other("release byte not sent"))
    }
}

/// What the launcher received while blocked.
#[derive(Debug)]
pub(crate) enum Received {
    /// The channel closed: never run anything.
    Eof,
    /// The release with the pipe ends.
    Release(ChildEnds),
}

/// Blocks for the release (launcher side).
pub(crate) fn recv_release(sock: &UnixStream) -> io::Result<Received> {
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(3))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut byte = [0u8; 1];
    let msg = loop {
        match rustix::net::recvmsg(
            sock,
            &mut [IoSliceMut::new(&mut byte)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Ok(m) => break m,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    if msg.bytes == 0 {
        return Ok(Received::Eof);
    }
    let mut fds: Vec<OwnedFd> = Vec::with_capacity(3);
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = m {
            fds.extend(received);
        }
    }
    let [b] = byte;
    if b != crate::frame::RELEASE {
        return Err(io::Error::other(format!(
            "unexpected control byte {b:#04x} before release"
        )));
    }
    let mut it = fds.into_iter();
    match (it.next(), it.next(), it.next(), it.next()) {
        (Some(stdin), Some(stdout), Some(stderr), None) => Ok(Received::Release(ChildEnds {
            stdin,
            stdout,
            stderr,
        })),
        _ => Err(io::Error::other("release without exactly three pipe ends")),
    }
}
