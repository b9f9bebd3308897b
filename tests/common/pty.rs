//! A program run on a real pseudo-terminal: what it writes is collected by a reader thread; the test types into it
//! and waits for text to appear (ANSI escape sequences and carriage returns removed).

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

pub struct PtyProcess {
    master: File,
    output: Arc<Mutex<Vec<u8>>>,
    child: Child,
    /// Position in the cleaned output up to which `expect` has consumed.
    cursor: usize,
}

impl PtyProcess {
    /// Starts `command` as the session leader of a new terminal (so Ctrl-C typed there signals it).
    pub fn spawn(mut command: Command) -> PtyProcess {
        let (mut master, mut slave): (RawFd, RawFd) = (-1, -1);
        let size = libc::winsize {
            ws_row: 40,
            ws_col: 160,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: plain libc calls on descriptors this function owns.
        unsafe {
            let rc = libc::openpty(
                &mut master,
                &mut slave,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                &size,
            );
            assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
            for fd in [master, slave] {
                libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
            }
            let terminal = |fd: RawFd| {
                let copy = libc::dup(fd);
                assert!(copy >= 0, "dup: {}", std::io::Error::last_os_error());
                Stdio::from_raw_fd(copy)
            };
            command
                .stdin(terminal(slave))
                .stdout(terminal(slave))
                .stderr(terminal(slave));
            command.pre_exec(|| {
                if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY as _, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn().expect("starting the program on the terminal");
        // SAFETY: the slave end now belongs to the child (and the Stdio copies were closed by spawn); the master is
        // ours alone.
        let master = unsafe {
            libc::close(slave);
            File::from_raw_fd(master)
        };
        let output = Arc::new(Mutex::new(Vec::new()));
        let mut reader = master.try_clone().expect("cloning the terminal");
        let collected = output.clone();
        thread::spawn(move || {
            let mut buffer = [0u8; 4096];
            // Reading fails (EIO) once the child has exited and closed the terminal.
            while let Ok(n) = reader.read(&mut buffer) {
                if n == 0 {
                    break;
                }
                collected.lock().unwrap().extend_from_slice(&buffer[..n]);
            }
        });
        PtyProcess {
            master,
            output,
            child,
            cursor: 0,
        }
    }

    /// Types bytes as a user would (`\r` is Enter, `\x03` Ctrl-C, `\x04` Ctrl-D).
    pub fn send(&mut self, bytes: &str) {
        self.master.write_all(bytes.as_bytes()).unwrap();
        self.master.flush().unwrap();
    }

    /// Everything written so far, escape sequences and carriage returns removed.
    pub fn screen(&self) -> String {
        let raw = self.output.lock().unwrap().clone();
        let valid = match std::str::from_utf8(&raw) {
            Ok(text) => text.len(),
            Err(error) => error.valid_up_to(),
        };
        clean(std::str::from_utf8(&raw[..valid]).unwrap())
    }

    /// Waits until the not yet consumed output satisfies `found` (which returns the end of the match in the text it
    /// is given); returns the text up to there and consumes it.
    pub fn expect_with(&mut self, what: &str, timeout: Duration, found: impl Fn(&str) -> Option<usize>) -> String {
        let start = Instant::now();
        loop {
            let screen = self.screen();
            let rest = &screen[self.cursor..];
            if let Some(end) = found(rest) {
                let text = rest[..end].to_string();
                self.cursor += end;
                return text;
            }
            if start.elapsed() > timeout {
                let status = self.child.try_wait().ok().flatten();
                panic!("timed out after {timeout:?} waiting for {what}; program status {status:?}; output so far:\n{screen}");
            }
            thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for `needle`; returns the text before it and consumes both.
    pub fn expect(&mut self, needle: &str, timeout: Duration) -> String {
        let mut text = self.expect_with(&format!("{needle:?}"), timeout, |rest| {
            rest.find(needle).map(|position| position + needle.len())
        });
        text.truncate(text.len() - needle.len());
        text
    }

    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            if start.elapsed() > timeout {
                let _ = self.child.kill();
                panic!(
                    "the program did not exit within {timeout:?}; output:\n{}",
                    self.screen()
                );
            }
            thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for PtyProcess {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Removes ANSI escape sequences (CSI and two-byte ones) and carriage returns.
fn clean(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\x1b' => {
                if let Some('[') = chars.next() {
                    for c in chars.by_ref() {
                        if ('@'..='~').contains(&c) {
                            break;
                        }
                    }
                }
            }
            '\r' => {}
            _ => out.push(c),
        }
    }
    out
}
