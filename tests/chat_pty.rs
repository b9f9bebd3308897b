//! `lily chat` on a real pseudo-terminal with the default model: a turn answered in verse that ends by itself,
//! `/reset`, Ctrl-C stopping a long answer without quitting, Ctrl-C at the prompt, `/exit`, Ctrl-D.

#![cfg(unix)]

mod common;

use std::process::Command;
use std::time::Duration;

use common::pty::PtyProcess;

/// Loading the model (and unpacking it into the cache on a fresh machine) takes a few seconds.
const START: Duration = Duration::from_secs(180);
/// A whole answer of the default model on a slow, busy machine.
const ANSWER: Duration = Duration::from_secs(180);
const PROMPT: &str = "\n> ";

fn start_chat(extra: &[&str]) -> PtyProcess {
    let mut command = Command::new(env!("CARGO_BIN_EXE_lily"));
    command.arg("chat").args(["--temperature", "0"]).args(extra);
    command
        .env_remove("LILY_MODEL")
        .env_remove("NO_COLOR")
        .env("TERM", "xterm-256color");
    let mut chat = PtyProcess::spawn(command);
    let banner = chat.expect(PROMPT, START);
    assert!(banner.contains("lily chat"), "banner: {banner:?}");
    chat
}

/// Types a line and returns what the program printed up to its next prompt (the echo of the line removed).
fn say(chat: &mut PtyProcess, line: &str, timeout: Duration) -> String {
    chat.send(&format!("{line}\r"));
    chat.expect(&format!("{line}\n"), Duration::from_secs(30));
    chat.expect(PROMPT, timeout)
}

fn words(text: &str) -> Vec<&str> {
    text.split(|c: char| !c.is_alphabetic() && c != '\'')
        .filter(|word| word.chars().any(char::is_alphabetic))
        .collect()
}

#[test]
fn chat_turn_reset_interrupt_and_exit() {
    let mut chat = start_chat(&["--max-tokens", "2000"]);

    // A turn: the model answers in (Shakespearean) English and ends its turn itself, well before --max-tokens.
    let reply = say(&mut chat, "What light through yonder window breaks?", ANSWER);
    let reply_words = words(&reply);
    assert!(reply_words.len() >= 4, "expected an English reply, got {reply:?}");
    assert!(
        reply.chars().filter(char::is_ascii_alphabetic).count() > 10,
        "{reply:?}"
    );
    assert!(
        !reply.contains("[interrupted]") && !reply.contains("[stopped"),
        "the reply did not end by itself: {reply:?}"
    );
    assert!(!reply.contains("error"), "{reply:?}");
    assert!(
        !reply.contains("<|im_end|>") && !reply.contains("<think>"),
        "special tokens shown: {reply:?}"
    );

    // Ctrl-C at the prompt does not quit.
    chat.send("\x03");
    chat.expect("Ctrl-C again", Duration::from_secs(30));
    chat.expect(PROMPT, Duration::from_secs(30));
    assert!(chat.is_running());

    let reset = say(&mut chat, "/reset", Duration::from_secs(30));
    assert!(reset.contains("conversation cleared"), "{reset:?}");

    // A long answer (up to 2000 tokens) stopped by Ctrl-C once it is under way.
    chat.send("Recite the whole play, from the first act to the last.\r");
    chat.expect("to the last.\n", Duration::from_secs(30));
    let started = chat.expect_with("the answer to start", ANSWER, |rest| {
        let letters = rest.char_indices().filter(|(_, c)| c.is_alphabetic()).nth(4)?;
        Some(letters.0 + letters.1.len_utf8())
    });
    chat.send("\x03");
    let rest = chat.expect(PROMPT, Duration::from_secs(60));
    assert!(
        rest.contains("[interrupted]"),
        "expected the answer to be interrupted: {started}{rest}"
    );
    assert!(chat.is_running(), "Ctrl-C during an answer quit the chat");

    // Still usable after the interrupt.
    let again = say(&mut chat, "/system You are Juliet.", Duration::from_secs(30));
    assert!(again.contains("system prompt set"), "{again:?}");

    chat.send("/exit\r");
    let status = chat.wait_exit(Duration::from_secs(30));
    assert!(status.success(), "/exit: {status:?}");
}

#[test]
fn folded_thinking_still_shows_an_answer_written_in_the_think_block() {
    // With thinking asked for, the default model answers inside the think block that the prompt opens and never
    // closes it. Folded, the thinking is a marker while it runs; then that text is shown, as the answer.
    let mut chat = start_chat(&["--think", "--hide-thinking", "--max-tokens", "2000"]);
    let reply = say(&mut chat, "What light through yonder window breaks?", ANSWER);
    let answer = reply.rsplit("thinking…").next().unwrap();
    assert!(
        words(answer).len() >= 4,
        "expected an English answer after the thinking marker, got {reply:?}"
    );
    assert!(
        !reply.contains("[interrupted]") && !reply.contains("[stopped"),
        "{reply:?}"
    );
    chat.send("/exit\r");
    let status = chat.wait_exit(Duration::from_secs(30));
    assert!(status.success(), "/exit: {status:?}");
}

#[test]
fn ctrl_d_and_double_ctrl_c_quit() {
    let mut chat = start_chat(&["--no-think"]);
    chat.send("\x04");
    let status = chat.wait_exit(Duration::from_secs(30));
    assert!(status.success(), "Ctrl-D: {status:?}");

    let mut chat = start_chat(&["--hide-thinking"]);
    chat.send("\x03");
    chat.expect("Ctrl-C again", Duration::from_secs(30));
    chat.send("\x03");
    let status = chat.wait_exit(Duration::from_secs(30));
    assert!(status.success(), "Ctrl-C twice: {status:?}");
}
