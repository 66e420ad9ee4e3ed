//! A terminal the tests can type into and read the screen of: a private
//! tmux server (its own socket, no user configuration) running one
//! program per session, driven with `send-keys` and read with
//! `capture-pane`, as an operator's terminal would be.
//!
//! Must never: touch the user's tmux server (every call names the private
//! socket).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Lines of scrollback each pane keeps (the tests read whole sessions
/// back).
pub const HISTORY_LINES: u32 = 200_000;

/// A private tmux server.
#[derive(Debug)]
pub struct Tmux {
    socket: PathBuf,
}

fn tmux_bin() -> &'static str {
    "tmux"
}

impl Tmux {
    /// A private server whose socket lives in `dir` (started by the first
    /// session).
    #[must_use]
    pub fn new(dir: &Path) -> Self {
        Self {
            socket: dir.join("tmux.sock"),
        }
    }

    fn cmd(&self) -> Command {
        let mut c = Command::new(tmux_bin());
        c.arg("-S").arg(&self.socket).arg("-f").arg("/dev/null");
        c
    }

    fn run(&self, args: &[&str]) -> String {
        let out = self
            .cmd()
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("tmux {args:?}: {e} (is tmux installed?)"));
        assert!(
            out.status.success(),
            "tmux {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Starts session `name`, `cols` x `rows`, running `argv` with `env`
    /// set (the pane's process is the program itself: killing the pane's
    /// pid kills it). The pane stays after the program exits, so its last
    /// screen can be read.
    pub fn start(&self, name: &str, cols: u16, rows: u16, env: &[(&str, &str)], argv: &[&str]) {
        let mut line = String::from("exec env");
        for (k, v) in env {
            line.push(' ');
            line.push_str(&shell_quote(&format!("{k}={v}")));
        }
        for a in argv {
            line.push(' ');
            line.push_str(&shell_quote(a));
        }
        let (cols, rows) = (cols.to_string(), rows.to_string());
        let history = HISTORY_LINES.to_string();
        self.run(&[
            "start-server",
            ";",
            "set-option",
            "-g",
            "history-limit",
            &history,
            ";",
            "set-option",
            "-g",
            "remain-on-exit",
            "on",
            ";",
            "new-session",
            "-d",
            "-s",
            name,
            "-x",
            &cols,
            "-y",
            &rows,
            &line,
        ]);
    }

    /// Types `text` literally (no key names).
    pub fn type_text(&self, name: &str, text: &str) {
        self.run(&["send-keys", "-t", name, "-l", text]);
    }

    /// Presses keys by name (`Enter`, `C-c`, `Escape`).
    pub fn keys(&self, name: &str, keys: &[&str]) {
        let mut args = vec!["send-keys", "-t", name];
        args.extend_from_slice(keys);
        self.run(&args);
    }

    /// Resizes the session's window.
    pub fn resize(&self, name: &str, cols: u16, rows: u16) {
        let (cols, rows) = (cols.to_string(), rows.to_string());
        self.run(&["resize-window", "-t", name, "-x", &cols, "-y", &rows]);
    }

    /// The visible screen, one line per row.
    #[must_use]
    pub fn screen(&self, name: &str) -> String {
        self.run(&["capture-pane", "-p", "-t", name])
    }

    /// The whole pane: scrollback and screen, wrapped lines joined.
    #[must_use]
    pub fn history(&self, name: &str) -> String {
        self.run(&["capture-pane", "-p", "-J", "-S", "-", "-E", "-", "-t", name])
    }

    /// The pid of the program the pane runs.
    #[must_use]
    pub fn pid(&self, name: &str) -> u32 {
        self.run(&["display-message", "-p", "-t", name, "#{pane_pid}"])
            .trim()
            .parse()
            .expect("a pane pid")
    }

    /// Whether the pane's program has exited.
    #[must_use]
    pub fn dead(&self, name: &str) -> bool {
        self.run(&["display-message", "-p", "-t", name, "#{pane_dead}"])
            .trim()
            == "1"
    }

    /// Waits until `ok` holds for the screen (or the whole pane when
    /// `whole`); panics with the screen after `max`.
    pub fn wait(
        &self,
        name: &str,
        what: &str,
        max: Duration,
        whole: bool,
        ok: impl Fn(&str) -> bool,
    ) -> String {
        let until = Instant::now() + max;
        loop {
            let s = if whole {
                self.history(name)
            } else {
                self.screen(name)
            };
            if ok(&s) {
                return s;
            }
            assert!(
                Instant::now() < until,
                "{what}: not within {max:?}; the screen:\n{s}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until the screen shows `needle`.
    pub fn wait_for(&self, name: &str, needle: &str, max: Duration) -> String {
        self.wait(
            name,
            &format!("{needle:?} on the screen"),
            max,
            false,
            |s| s.contains(needle),
        )
    }

    /// Ends session `name` (its program gets SIGHUP).
    pub fn kill_session(&self, name: &str) {
        let _ = self.cmd().args(["kill-session", "-t", name]).output();
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.cmd().arg("kill-server").output();
    }
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_is_typed_into_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let t = Tmux::new(dir.path());
        t.start("s", 80, 24, &[("PS1", "$ ")], &["sh"]);
        t.type_text("s", "echo $((6*7))x");
        t.keys("s", &["Enter"]);
        let screen = t.wait_for("s", "42x", Duration::from_secs(10));
        assert!(screen.contains("echo $((6*7))x"), "{screen}");
        assert!(t.pid("s") > 1);
        t.keys("s", &["C-d"]);
        t.wait(
            "s",
            "the shell exits",
            Duration::from_secs(10),
            false,
            |_| t.dead("s"),
        );
        assert!(t.history("s").contains("42x"));
    }

    #[test]
    fn quoting_keeps_every_byte() {
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), "'it'\\''s'");
    }
}
