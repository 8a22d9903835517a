//! What both binaries write into an events.k8s.io/v1 Event (through kube-runtime's
//! `Recorder`) that the API server bounds.

/// The most bytes the API server takes in an events.k8s.io/v1 Event's `note`; it refuses an
/// Event with more.
pub const NOTE_BYTES: usize = 1024;

/// `message` as an Event's note: whole when it fits in [`NOTE_BYTES`], else cut on a character
/// boundary with ` …` after it, saying so (the caller's log, and the controller's pod
/// condition, keep the message whole).
pub fn note(message: &str) -> String {
    const CUT: &str = " …";
    if message.len() <= NOTE_BYTES {
        return message.to_owned();
    }
    let mut end = NOTE_BYTES - CUT.len();
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{CUT}", &message[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_note_is_the_whole_message_when_it_fits() {
        let message = "x".repeat(NOTE_BYTES);
        assert_eq!(note(&message), message);
    }

    #[test]
    fn a_longer_message_is_cut_at_a_character_within_the_limit_and_says_so() {
        // Two-byte characters: the limit falls inside one.
        let message = "é".repeat(NOTE_BYTES);
        let cut = note(&message);
        assert!(cut.len() <= NOTE_BYTES, "{}", cut.len());
        assert!(cut.ends_with(" …"));
        assert!(message.starts_with(cut.trim_end_matches(" …")));
    }
}
