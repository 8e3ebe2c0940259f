//! Stop strings (`stop` in a request), as vLLM and OpenAI apply them: the output ends at
//! the first place its text contains one of them, the stop string itself is not sent,
//! and the choice finishes with `finish_reason: "stop"`. The ranks see token ids only, so
//! the front door watches the text and cancels the rest of the request on its rank.
//!
//! A streamed answer must not send text that a later token could turn into the start of
//! a stop string, so the last `longest stop - 1` bytes stay held back until they can no
//! longer begin one (or the output ends).

/// What the front door may send after new text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Released {
    /// Text safe to send now (may be empty).
    pub text: String,
    /// A stop string matched: the output ends with `text`.
    pub stopped: bool,
}

/// Watches one output's text for its request's stop strings.
#[derive(Debug, Clone)]
pub struct StopWatch {
    stops: Vec<String>,
    /// The whole output so far.
    text: String,
    /// Bytes of `text` already released.
    released: usize,
    /// A stop string matched: nothing more is released.
    stopped: bool,
}

impl StopWatch {
    /// Watches for `stops` (none: every piece of text is released at once).
    pub fn new(stops: Vec<String>) -> StopWatch {
        StopWatch {
            stops,
            text: String::new(),
            released: 0,
            stopped: false,
        }
    }

    /// Whether a stop string matched.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Adds the output's next piece of text; says what may be sent.
    pub fn push(&mut self, piece: &str) -> Released {
        if self.stopped {
            return Released {
                text: String::new(),
                stopped: true,
            };
        }
        // A match may start in the held-back tail, never in text already released (that
        // text was checked when it was released).
        let search_from = self.released;
        self.text.push_str(piece);
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.text[search_from..].find(s.as_str()))
            .min();
        if let Some(at) = first {
            self.stopped = true;
            return Released {
                text: self.take_until(search_from + at),
                stopped: true,
            };
        }
        let hold = self.stops.iter().map(String::len).max().unwrap_or(1) - 1;
        let mut until = self.text.len().saturating_sub(hold).max(self.released);
        while !self.text.is_char_boundary(until) {
            until -= 1;
        }
        Released {
            text: self.take_until(until),
            stopped: false,
        }
    }

    /// Adds text of tokens before the request's `min_tokens`: no stop string may end the
    /// output there, so it is all released, and a later match must begin after it.
    pub fn push_unwatched(&mut self, piece: &str) -> Released {
        if self.stopped {
            return Released {
                text: String::new(),
                stopped: true,
            };
        }
        self.text.push_str(piece);
        let end = self.text.len();
        Released {
            text: self.take_until(end),
            stopped: false,
        }
    }

    /// The model's end of sequence (`serve --model`): the output ends here as at a stop
    /// string; what was held back is released, since nothing can extend it now.
    pub fn end_of_sequence(&mut self) -> Released {
        let text = self.finish();
        self.stopped = true;
        Released {
            text,
            stopped: true,
        }
    }

    /// What is still held back, once the output ended without a stop string.
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        let end = self.text.len();
        self.take_until(end)
    }

    fn take_until(&mut self, end: usize) -> String {
        let out = self.text[self.released..end].to_string();
        self.released = end;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut w = StopWatch::new(stops.iter().map(|s| s.to_string()).collect());
        let mut sent = String::new();
        for p in pieces {
            let r = w.push(p);
            sent.push_str(&r.text);
            if r.stopped {
                return (sent, true);
            }
        }
        sent.push_str(&w.finish());
        (sent, false)
    }

    #[test]
    fn the_end_of_sequence_releases_the_held_back_text_and_ends_the_output() {
        let mut w = StopWatch::new(vec!["xyz".into()]);
        // The last `longest stop - 1` bytes are held back.
        assert_eq!(w.push("hello ab").text, "hello ");
        let end = w.end_of_sequence();
        assert_eq!(
            end,
            Released {
                text: "ab".into(),
                stopped: true
            }
        );
        assert!(w.stopped());
        assert_eq!(w.push("more").text, "");
        assert_eq!(w.finish(), "");
    }

    #[test]
    fn without_stop_strings_text_is_released_as_it_comes() {
        let mut w = StopWatch::new(Vec::new());
        assert_eq!(w.push("lorem").text, "lorem");
        assert_eq!(w.push(" ipsum").text, " ipsum");
        assert_eq!(w.finish(), "");
    }

    #[test]
    fn the_output_ends_before_the_first_stop_string() {
        assert_eq!(
            run(&["dolor"], &["lorem", " ipsum", " dolor", " sit"]),
            ("lorem ipsum ".to_string(), true)
        );
        // The earliest match wins, whichever stop string it is.
        assert_eq!(
            run(&["sit", "ipsum"], &["lorem ipsum dolor sit"]),
            ("lorem ".to_string(), true)
        );
    }

    #[test]
    fn a_stop_string_split_across_pieces_is_never_sent_in_part() {
        let mut w = StopWatch::new(vec!["m do".into()]);
        let a = w.push("lorem");
        // The last `longest stop - 1` bytes ("rem") could begin the stop string: held
        // back (as vLLM does), and only what precedes the match goes out.
        assert_eq!(a.text, "lo");
        let b = w.push(" do");
        assert!(b.stopped);
        assert_eq!(b.text, "re");
    }

    #[test]
    fn held_back_text_is_sent_when_the_output_ends_without_a_match() {
        assert_eq!(
            run(&["amet!"], &["lorem", " amet"]),
            ("lorem amet".to_string(), false)
        );
    }

    #[test]
    fn text_before_min_tokens_is_never_a_stop_and_a_later_match_begins_after_it() {
        let mut w = StopWatch::new(vec!["ab".into()]);
        // Held back text ("x") is released with the unwatched piece.
        assert_eq!(w.push("x").text, "");
        assert_eq!(
            w.push_unwatched(" ab a"),
            Released {
                text: "x ab a".into(),
                stopped: false
            }
        );
        // "a" + "b" would straddle the floor: not a stop; a whole one after it is.
        assert!(!w.push("b").stopped);
        let r = w.push(" ab c");
        assert!(r.stopped);
        assert_eq!(r.text, "b ");
    }

    #[test]
    fn held_back_text_never_splits_a_character() {
        let mut w = StopWatch::new(vec!["xy".into()]);
        let r = w.push("aé");
        assert!(!r.stopped);
        assert_eq!(r.text, "a");
        assert_eq!(w.finish(), "é");
    }
}
