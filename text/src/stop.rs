//! Stop strings matched across token boundaries. Text that could be the start of a stop string is held
//! back until it is known not to be; on a match the stop string (and everything after it) is trimmed.

/// What the caller may emit after a [`StopMatcher::push`].
#[derive(Debug, Default, PartialEq, Eq)]
pub struct StopOutcome {
    /// Text safe to send to the client now.
    pub text: String,
    /// Set when a stop string matched: the request must end; `text` is the final piece.
    pub matched: Option<String>,
}

pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
    include_stop: bool,
    done: bool,
}

impl StopMatcher {
    /// Empty stop strings are ignored. `include_stop` keeps the matched string in the output (vLLM's
    /// `include_stop_str_in_output`).
    pub fn new(stops: &[String], include_stop: bool) -> Self {
        let stops = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        Self { stops, pending: String::new(), include_stop, done: false }
    }

    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// Feeds newly decoded text. After a match every further push returns nothing.
    pub fn push(&mut self, delta: &str) -> StopOutcome {
        if self.done {
            return StopOutcome::default();
        }
        if self.stops.is_empty() {
            return StopOutcome { text: delta.to_owned(), matched: None };
        }
        self.pending.push_str(delta);
        // Earliest match wins; among matches at the same place, the longest.
        let hit = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()).map(|at| (at, std::cmp::Reverse(s.len()), s)))
            .min();
        if let Some((at, _, stop)) = hit {
            let end = if self.include_stop { at + stop.len() } else { at };
            let text = self.pending[..end].to_owned();
            let matched = Some(stop.clone());
            self.pending.clear();
            self.done = true;
            return StopOutcome { text, matched };
        }
        let keep = self.held_back_len();
        let split = self.pending.len() - keep;
        let text = self.pending[..split].to_owned();
        self.pending.drain(..split);
        StopOutcome { text, matched: None }
    }

    /// Held-back text at the end of the request (no stop string can complete any more).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// Length of the longest suffix of `pending` that is a proper prefix of some stop string.
    fn held_back_len(&self) -> usize {
        let p = self.pending.as_str();
        let mut best = 0;
        for stop in &self.stops {
            let max = stop.len().saturating_sub(1).min(p.len());
            for len in (best + 1..=max).rev() {
                let start = p.len() - len;
                if p.is_char_boundary(start) && stop.starts_with(&p[start..]) {
                    best = len;
                    break;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str], include: bool) -> (String, Option<String>) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops, include);
        let mut out = String::new();
        for p in pieces {
            let o = m.push(p);
            out.push_str(&o.text);
            if o.matched.is_some() {
                return (out, o.matched);
            }
        }
        out.push_str(&m.flush());
        (out, None)
    }

    #[test]
    fn a_stop_split_over_three_tokens_is_trimmed() {
        let (out, m) = run(&["END!"], &["hello E", "N", "D! tail"], false);
        assert_eq!(out, "hello ");
        assert_eq!(m.as_deref(), Some("END!"));
    }

    #[test]
    fn held_back_text_is_released_when_the_match_fails() {
        let stops = vec!["END".to_string()];
        let mut m = StopMatcher::new(&stops, false);
        assert_eq!(m.push("abc E").text, "abc ");
        assert_eq!(m.push("N").text, "");
        assert_eq!(m.push("x").text, "ENx");
        assert_eq!(m.flush(), "");
    }

    #[test]
    fn earliest_match_wins_and_include_stop_keeps_it() {
        assert_eq!(run(&["world", "lo"], &["hello world"], false).0, "hel");
        assert_eq!(run(&["lo"], &["hello world"], true).0, "hello");
    }

    #[test]
    fn unfinished_prefix_is_flushed_at_the_end() {
        let (out, m) = run(&["STOP"], &["all fine ST"], false);
        assert_eq!(out, "all fine ST");
        assert!(m.is_none());
    }

    #[test]
    fn multibyte_stop_strings_hold_back_on_char_boundaries() {
        let (out, m) = run(&["日本語"], &["x日", "本", "語y"], false);
        assert_eq!(out, "x");
        assert!(m.is_some());
    }
}
