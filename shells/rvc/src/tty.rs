//! rvc's own terminal while it shows a remote one: raw mode on its stdin
//! (every key, Ctrl-C, Ctrl-Z and Ctrl-\ included, goes to the remote
//! terminal as a byte) and the window size.
//!
//! Raw mode is held by a guard that puts the saved settings back when it
//! is dropped: on a normal end, an error returned through it, a panic
//! unwinding through it, and a signal (the attach loop turns TERM, HUP,
//! INT and QUIT into a normal end). Without a terminal on stdin (a pipe,
//! a file) nothing is changed.

use rustix::termios::{OptionalActions, Termios, isatty, tcgetattr, tcgetwinsize, tcsetattr};

use crate::exit::Failure;

/// Raw mode on stdin until dropped.
#[derive(Debug)]
pub(crate) struct RawMode {
    /// The settings to put back; none when stdin is not a terminal.
    saved: Option<Termios>,
}

impl RawMode {
    /// Puts stdin in raw mode when it is a terminal.
    pub(crate) fn enter() -> Result<Self, Failure> {
        let stdin = std::io::stdin();
        if !isatty(&stdin) {
            return Ok(Self { saved: None });
        }
        let saved = tcgetattr(&stdin)
            .map_err(|e| Failure::internal(format!("reading the terminal's settings: {e}")))?;
        let mut raw = saved.clone();
        raw.make_raw();
        tcsetattr(&stdin, OptionalActions::Now, &raw)
            .map_err(|e| Failure::internal(format!("putting the terminal in raw mode: {e}")))?;
        Ok(Self { saved: Some(saved) })
    }

    /// Whether stdin is in raw mode (its line ends need a carriage
    /// return, and Ctrl-C is a byte, not a signal).
    pub(crate) fn is_raw(&self) -> bool {
        self.saved.is_some()
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        if let Some(saved) = self.saved.take() {
            // nothing else can be done if this fails: the terminal is
            // gone (a hang-up), or `stty sane` puts it right
            let _ = tcsetattr(std::io::stdin(), OptionalActions::Now, &saved);
        }
    }
}

/// Whether stdin is a terminal.
pub(crate) fn stdin_is_terminal() -> bool {
    isatty(std::io::stdin())
}

/// Whether stdout is a terminal.
pub(crate) fn stdout_is_terminal() -> bool {
    isatty(std::io::stdout())
}

/// The local window size (rows, columns), from stdout or stdin, when one
/// of them is a terminal that knows it.
pub(crate) fn window_size() -> Option<(u16, u16)> {
    let of = |w: rustix::termios::Winsize| {
        (w.ws_row > 0 && w.ws_col > 0).then_some((w.ws_row, w.ws_col))
    };
    tcgetwinsize(std::io::stdout())
        .ok()
        .and_then(of)
        .or_else(|| tcgetwinsize(std::io::stdin()).ok().and_then(of))
}
