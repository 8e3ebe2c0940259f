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
///
/// Matching is incremental: text already released was searched when it came, so a new
/// match must end in the new piece, and for a stop string `s` only the last
/// `s.len() - 1` bytes before the piece and the piece itself are searched. Only the
/// held-back text is kept, never the whole output.
#[derive(Debug, Clone)]
pub struct StopWatch {
    stops: Vec<String>,
    /// The output's text not yet released (what a later piece could still turn into
    /// the start of a stop string).
    held: String,
    /// Bytes held back after a piece: the longest stop string's length less one.
    hold: usize,
    /// A stop string matched: nothing more is released.
    stopped: bool,
    /// Bytes searched so far (what the tests bound).
    #[cfg(test)]
    searched: usize,
}

impl StopWatch {
    /// Watches for `stops` (none: every piece of text is released at once).
    pub fn new(stops: Vec<String>) -> StopWatch {
        let hold = stops
            .iter()
            .map(String::len)
            .max()
            .unwrap_or(1)
            .saturating_sub(1);
        StopWatch {
            stops,
            held: String::new(),
            hold,
            stopped: false,
            #[cfg(test)]
            searched: 0,
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
        let before = self.held.len();
        self.held.push_str(piece);
        // A match may start in the held-back text, never in text already released
        // (that text was checked when it was released), and it ends in `piece`.
        let mut first = None;
        for s in &self.stops {
            let mut from = before.saturating_sub(s.len().saturating_sub(1));
            while !self.held.is_char_boundary(from) {
                from -= 1;
            }
            #[cfg(test)]
            {
                self.searched += self.held.len() - from;
            }
            if let Some(at) = self.held[from..].find(s.as_str()) {
                first = Some(first.map_or(from + at, |f: usize| f.min(from + at)));
            }
        }
        if let Some(at) = first {
            self.stopped = true;
            let text = self.take_until(at);
            self.held = String::new();
            return Released {
                text,
                stopped: true,
            };
        }
        let mut until = self.held.len().saturating_sub(self.hold);
        while !self.held.is_char_boundary(until) {
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
        self.held.push_str(piece);
        Released {
            text: std::mem::take(&mut self.held),
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
        std::mem::take(&mut self.held)
    }

    /// Releases the held-back text up to `end`.
    fn take_until(&mut self, end: usize) -> String {
        let rest = self.held.split_off(end);
        std::mem::replace(&mut self.held, rest)
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
    fn a_stop_string_spanning_two_pieces_is_found() {
        assert_eq!(run(&["abc"], &["xxab", "cyy"]), ("xx".to_string(), true));
        // Over three pieces, the middle one wholly inside it.
        assert_eq!(
            run(&["stop here", "q"], &["go st", "op h", "ere now"]),
            ("go ".to_string(), true)
        );
    }

    /// The matcher before it was incremental: the whole held-back text searched again
    /// for every piece, and the whole output kept.
    struct WholeTextWatch {
        stops: Vec<String>,
        text: String,
        released: usize,
        stopped: bool,
    }

    impl WholeTextWatch {
        fn push(&mut self, piece: &str, watched: bool) -> Released {
            if self.stopped {
                return Released {
                    text: String::new(),
                    stopped: true,
                };
            }
            let from = self.released;
            self.text.push_str(piece);
            let first = if watched {
                self.stops
                    .iter()
                    .filter_map(|s| self.text[from..].find(s.as_str()))
                    .min()
            } else {
                None
            };
            let (until, stopped) = match first {
                Some(at) => (from + at, true),
                None if !watched => (self.text.len(), false),
                None => {
                    let hold = self.stops.iter().map(String::len).max().unwrap_or(1) - 1;
                    let mut until = self.text.len().saturating_sub(hold).max(self.released);
                    while !self.text.is_char_boundary(until) {
                        until -= 1;
                    }
                    (until, false)
                }
            };
            self.stopped = stopped;
            let text = self.text[self.released..until].to_string();
            self.released = until;
            Released { text, stopped }
        }
    }

    /// A small deterministic generator (no dependency for it).
    struct SplitMix(u64);

    impl SplitMix {
        fn below(&mut self, n: usize) -> usize {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z ^ (z >> 31)) % n as u64) as usize
        }

        /// Up to `max` characters from a small alphabet with multi-byte ones, so that
        /// matches are frequent and pieces end inside held-back text and characters.
        fn text(&mut self, max: usize) -> String {
            const ALPHABET: [&str; 5] = ["a", "b", " ", "é", "漢"];
            (0..self.below(max + 1))
                .map(|_| ALPHABET[self.below(ALPHABET.len())])
                .collect()
        }
    }

    /// Over seeded random stop strings and pieces: every release is the one the
    /// whole-text matcher makes (with `min_tokens`' unwatched pieces mixed in), a run of
    /// watched pieces ends exactly before the first match a search of the whole text
    /// finds, and the bytes searched for each piece are the piece and each stop
    /// string's `len - 1` bytes before it, never the whole output.
    #[test]
    fn incremental_matching_finds_what_a_whole_text_search_finds() {
        let mut rng = SplitMix(29);
        let mut stopped_runs = 0;
        for case in 0..3000 {
            let stops: Vec<String> = (0..1 + rng.below(4))
                .map(|_| {
                    let s = rng.text(4);
                    if s.is_empty() { "a".to_string() } else { s }
                })
                .collect();
            let pieces: Vec<String> = (0..rng.below(24)).map(|_| rng.text(3)).collect();
            let unwatched = case % 3 == 0;
            let mut w = StopWatch::new(stops.clone());
            let mut reference = WholeTextWatch {
                stops: stops.clone(),
                text: String::new(),
                released: 0,
                stopped: false,
            };
            let mut sent = String::new();
            for (i, piece) in pieces.iter().enumerate() {
                let watched = !(unwatched && i < pieces.len() / 3);
                let searched = w.searched;
                let got = if watched {
                    w.push(piece)
                } else {
                    w.push_unwatched(piece)
                };
                let expected = reference.push(piece, watched);
                assert_eq!(got, expected, "case {case}: {stops:?} {pieces:?} at {i}");
                // Each stop string's window: its `len - 1` bytes before the piece (up
                // to 3 more to start on a character), and the piece.
                let window: usize = stops.iter().map(|s| s.len() - 1 + 3 + piece.len()).sum();
                assert!(
                    w.searched - searched <= window,
                    "case {case}: {} bytes searched for {piece:?}, over {window}: {stops:?} {pieces:?}",
                    w.searched - searched
                );
                assert!(
                    w.held.len() <= w.hold + 3,
                    "case {case}: {} bytes held",
                    w.held.len()
                );
                sent.push_str(&got.text);
            }
            let end = w.finish();
            sent.push_str(&end);
            if !unwatched {
                let whole: String = pieces.concat();
                let first = stops.iter().filter_map(|s| whole.find(s.as_str())).min();
                assert_eq!(w.stopped(), first.is_some(), "case {case}");
                assert_eq!(
                    sent,
                    whole[..first.unwrap_or(whole.len())],
                    "case {case}: {stops:?} {pieces:?}"
                );
                stopped_runs += usize::from(first.is_some());
            }
        }
        // The cases exercise both endings.
        assert!(stopped_runs > 300, "{stopped_runs} runs stopped");
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
