//! RVBox terminal core: the parts of an interactive terminal (rule R4)
//! that decide, as pure state machines shared by the PTY holder on the
//! client host, the client daemon, the server and `rvc`.
//!
//! Owns:
//! - [`ring::OutputRing`]: every output byte counted from the terminal's
//!   start, the last bytes kept in a bounded ring trimmed at line
//!   boundaries, and a reattach from any offset answered exactly or with
//!   an explicit count of the bytes that were cut;
//! - [`input`]: keys numbered by the viewer that typed them, held (bounded)
//!   while disconnected, resent on reattach, and applied to the PTY
//!   exactly once ([`input::KeyBuffer`] on the viewer's side,
//!   [`input::InputGate`] on the holder's);
//! - [`local`] and [`holder`]: the private protocol between the client
//!   daemon and a terminal's holder process (checksummed, bounded records;
//!   the token proof of the holder's identity), and the holder's decisions
//!   as a state machine;
//! - [`escape`]: the viewer's local escape sequences (`~.` detaches), as
//!   ssh's;
//! - [`asciicast`]: the recording as an asciicast v2 stream (output, input
//!   timing and resizes), written incrementally and read back for replay.
//!
//! Must never: do I/O, read a clock, or allocate without a bound taken
//! from its caller. Times arrive as inputs (conventions rules 1-3).
#![warn(missing_docs)]

pub mod asciicast;
pub mod escape;
pub mod holder;
pub mod input;
pub mod local;
pub mod ring;
