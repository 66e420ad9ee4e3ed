//! The viewer's local escape sequences, as ssh's: the escape character
//! (`~`) is recognised only first on a line (after Enter, or as the very
//! first key), and then:
//! - `~.` detaches (the terminal keeps running);
//! - `~?` lists the sequences;
//! - `~~` sends one `~`;
//! - `~` followed by anything else sends both keys.
//!
//! Keys pass through [`EscapeScanner::feed`], which returns what to send
//! and what to do, in order; a lone `~` at the start of a line is held
//! until the next key decides.

/// What the viewer does with a piece of typed input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Send these keys to the terminal.
    Send(Vec<u8>),
    /// Detach: leave the terminal running and exit the viewer.
    Detach,
    /// Show the list of escape sequences.
    Help,
}

/// The escape character.
pub const ESCAPE: u8 = b'~';

/// The help text for `~?`.
pub const HELP: &str = "Supported escape sequences:\r\n ~.  detach (the terminal keeps running)\r\n ~?  this message\r\n ~~  send the escape character\r\n(Escapes are recognised only after a newline.)\r\n";

/// Finds escape sequences in typed input.
#[derive(Debug, Clone)]
pub struct EscapeScanner {
    /// At the start of a line.
    line_start: bool,
    /// A `~` was typed first on a line and waits for the next key.
    pending: bool,
}

impl Default for EscapeScanner {
    fn default() -> Self {
        Self {
            line_start: true,
            pending: false,
        }
    }
}

impl EscapeScanner {
    /// Scans typed keys; returns the actions in order.
    pub fn feed(&mut self, keys: &[u8]) -> Vec<Action> {
        let mut out = Vec::new();
        let mut send = Vec::new();
        for &k in keys {
            if self.pending {
                self.pending = false;
                match k {
                    b'.' => {
                        flush(&mut out, &mut send);
                        out.push(Action::Detach);
                        // nothing typed after a detach is sent
                        return out;
                    }
                    b'?' => {
                        flush(&mut out, &mut send);
                        out.push(Action::Help);
                        self.line_start = true;
                        continue;
                    }
                    ESCAPE => {
                        send.push(ESCAPE);
                        self.line_start = false;
                        continue;
                    }
                    _ => send.push(ESCAPE),
                }
            } else if self.line_start && k == ESCAPE {
                self.pending = true;
                continue;
            }
            send.push(k);
            self.line_start = k == b'\r' || k == b'\n';
        }
        flush(&mut out, &mut send);
        out
    }

    /// Whether a `~` is held waiting for the next key.
    #[must_use]
    pub fn holding(&self) -> bool {
        self.pending
    }
}

fn flush(out: &mut Vec<Action>, send: &mut Vec<u8>) {
    if !send.is_empty() {
        out.push(Action::Send(std::mem::take(send)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sent(actions: &[Action]) -> Vec<u8> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Send(b) => Some(b.clone()),
                _ => None,
            })
            .flatten()
            .collect()
    }

    #[test]
    fn tilde_dot_first_on_a_line_detaches_and_sends_nothing_after() {
        let mut s = EscapeScanner::default();
        assert_eq!(
            s.feed(b"ls\r~.rm -rf /\r"),
            vec![Action::Send(b"ls\r".to_vec()), Action::Detach]
        );
        let mut s = EscapeScanner::default();
        assert_eq!(s.feed(b"~."), vec![Action::Detach]);
    }

    #[test]
    fn a_tilde_inside_a_line_is_just_a_key() {
        let mut s = EscapeScanner::default();
        assert_eq!(sent(&s.feed(b"cd ~.\r")), b"cd ~.\r");
    }

    #[test]
    fn the_decision_waits_for_the_next_key_across_pieces() {
        let mut s = EscapeScanner::default();
        assert_eq!(s.feed(b"~"), vec![]);
        assert!(s.holding());
        assert_eq!(s.feed(b"~"), vec![Action::Send(b"~".to_vec())]);
        let mut s = EscapeScanner::default();
        s.feed(b"\r~");
        assert_eq!(s.feed(b"x"), vec![Action::Send(b"~x".to_vec())]);
        let mut s = EscapeScanner::default();
        assert_eq!(s.feed(b"~?"), vec![Action::Help]);
        assert_eq!(
            s.feed(b"~."),
            vec![Action::Detach],
            "still first on the line"
        );
    }

    #[test]
    fn a_literal_tilde_is_not_first_on_the_line_any_more() {
        let mut s = EscapeScanner::default();
        assert_eq!(sent(&s.feed(b"~~.")), b"~.");
    }
}
