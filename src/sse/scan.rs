//! The common `chat.completion.chunk` read in one pass over its bytes.
//!
//! A relayed stream asks the same two questions of every event (does it carry
//! content, has a choice finished), and reading each event into structs costs
//! several times what relaying it does. This scan validates the JSON as it goes
//! and picks up those two facts on the way, building nothing. It answers only
//! where it cannot disagree with serde's reading ([`super::classify_data`]'s
//! fallback): an escaped or repeated key it reads, a field of an unexpected
//! type, an in-band error, a surrogate escape or deep nesting make it step
//! aside (`None`), and serde decides.

use super::Chunk;

/// serde_json stops at 128 levels; staying well below keeps the two readings
/// equal.
const MAX_DEPTH: u32 = 100;

/// The chunk's meaning, or `None` when serde must read it.
pub(super) fn chunk(data: &[u8]) -> Option<Chunk> {
    let mut scan = Scan { b: data, i: 0 };
    let facts = scan.top()?;
    scan.ws();
    if scan.i != data.len() {
        return None;
    }
    Some(if facts.content {
        Chunk::Content {
            finished: facts.finished,
        }
    } else {
        Chunk::NoContent {
            finished: facts.finished,
        }
    })
}

#[derive(Default)]
struct Facts {
    content: bool,
    finished: bool,
}

struct Scan<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Scan<'a> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn ws(&mut self) {
        // Compact JSON has none: one comparison says so.
        while let Some(&c) = self.b.get(self.i) {
            if c > b' ' || !matches!(c, b' ' | b'\t' | b'\n' | b'\r') {
                return;
            }
            self.i += 1;
        }
    }

    /// Skips whitespace and takes `byte`.
    fn eat(&mut self, byte: u8) -> Option<()> {
        self.ws();
        (self.peek()? == byte).then(|| self.i += 1)
    }

    /// The members of an object whose `{` is taken: `member` reads each
    /// value after its key (given raw, `None` when it had an escape).
    fn members(
        &mut self,
        mut member: impl FnMut(&mut Self, Option<&'a [u8]>) -> Option<()>,
    ) -> Option<()> {
        self.ws();
        if self.peek()? == b'}' {
            self.i += 1;
            return Some(());
        }
        loop {
            self.eat(b'"')?;
            let key = self.string()?;
            self.eat(b':')?;
            self.ws();
            member(self, key)?;
            self.ws();
            match self.peek()? {
                b',' => self.i += 1,
                b'}' => {
                    self.i += 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    /// The elements of an array whose `[` is taken.
    fn elements(&mut self, mut element: impl FnMut(&mut Self) -> Option<()>) -> Option<()> {
        self.ws();
        if self.peek()? == b']' {
            self.i += 1;
            return Some(());
        }
        loop {
            self.ws();
            element(self)?;
            self.ws();
            match self.peek()? {
                b',' => self.i += 1,
                b']' => {
                    self.i += 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    /// The top-level object: `choices` read, `error` only if null.
    fn top(&mut self) -> Option<Facts> {
        let mut facts = Facts::default();
        let (mut choices, mut error) = (false, false);
        self.eat(b'{')?;
        self.members(|s, key| match key? {
            b"choices" => {
                once(&mut choices)?;
                s.eat(b'[')?;
                s.elements(|s| s.choice(&mut facts))
            }
            // An in-band error is serde's to read (its code).
            b"error" => {
                once(&mut error)?;
                s.literal(b"null")
            }
            _ => s.value(1),
        })?;
        Some(facts)
    }

    fn choice(&mut self, facts: &mut Facts) -> Option<()> {
        let (mut delta, mut finish) = (false, false);
        self.eat(b'{')?;
        self.members(|s, key| match key? {
            b"delta" => {
                once(&mut delta)?;
                if s.peek()? == b'n' {
                    return s.literal(b"null");
                }
                s.eat(b'{')?;
                s.delta(facts)
            }
            b"finish_reason" => {
                once(&mut finish)?;
                let raw = s.raw_value(3)?;
                facts.finished |= raw != b"null";
                Some(())
            }
            _ => s.value(3),
        })
    }

    /// A delta object whose `{` is taken.
    fn delta(&mut self, facts: &mut Facts) -> Option<()> {
        let mut seen = [false; 5];
        self.members(|s, key| {
            let field = match key? {
                b"content" => 0,
                b"refusal" => 1,
                b"reasoning_content" => 2,
                b"tool_calls" => 3,
                b"function_call" => 4,
                _ => return s.value(4),
            };
            once(&mut seen[field])?;
            if field >= 3 {
                let raw = s.raw_value(4)?;
                facts.content |= raw != b"null" && raw != b"[]";
                return Some(());
            }
            // Text fields: a string or null, as serde's `Option<Cow<str>>`.
            if s.peek()? == b'n' {
                return s.literal(b"null");
            }
            s.eat(b'"')?;
            facts.content |= s.string()?.is_none_or(|text| !text.is_empty());
            Some(())
        })
    }

    /// Any value, validated and skipped; its raw bytes.
    fn raw_value(&mut self, depth: u32) -> Option<&'a [u8]> {
        let start = self.i;
        self.value(depth)?;
        Some(&self.b[start..self.i])
    }

    /// Any value at `depth`, validated and skipped.
    fn value(&mut self, depth: u32) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        match self.peek()? {
            b'"' => {
                self.i += 1;
                self.string().map(drop)
            }
            b'{' => {
                self.i += 1;
                self.members(|s, _| s.value(depth + 1))
            }
            b'[' => {
                self.i += 1;
                self.elements(|s| s.value(depth + 1))
            }
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            b'-' | b'0'..=b'9' => self.number(),
            _ => None,
        }
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        let end = self.i + word.len();
        (self.b.get(self.i..end)? == word).then(|| self.i = end)
    }

    /// A string whose `"` is taken, up to its closing quote: its raw bytes,
    /// or `Some(None)` when it held an escape (valid, but not read here).
    fn string(&mut self) -> Option<Option<&'a [u8]>> {
        let start = self.i;
        let mut escaped = false;
        loop {
            self.i = plain_run(self.b, self.i);
            match *self.b.get(self.i)? {
                b'"' => {
                    self.i += 1;
                    return Some((!escaped).then(|| &self.b[start..self.i - 1]));
                }
                b'\\' => {
                    self.i += 1;
                    escaped = true;
                    self.escape()?;
                }
                // Control characters are not allowed raw in a JSON string.
                _ => return None,
            }
        }
    }

    /// The rest of an escape after its `\`. A `\u` of a surrogate is left to
    /// serde, whose readings of lone halves differ by field.
    fn escape(&mut self) -> Option<()> {
        let c = self.peek()?;
        self.i += 1;
        match c {
            b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => Some(()),
            b'u' => {
                let hex = std::str::from_utf8(self.b.get(self.i..self.i + 4)?).ok()?;
                let unit = u16::from_str_radix(hex, 16).ok()?;
                if hex.starts_with('+') || (0xD800..=0xDFFF).contains(&unit) {
                    return None;
                }
                self.i += 4;
                Some(())
            }
            _ => None,
        }
    }

    /// A number as JSON writes it: `-?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?`.
    fn number(&mut self) -> Option<()> {
        if self.peek() == Some(b'-') {
            self.i += 1;
        }
        match self.peek()? {
            b'0' => self.i += 1,
            b'1'..=b'9' => self.digits(),
            _ => return None,
        }
        if self.peek() == Some(b'.') {
            self.i += 1;
            self.some_digits()?;
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.i += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.i += 1;
            }
            self.some_digits()?;
        }
        Some(())
    }

    fn digits(&mut self) {
        while let Some(b'0'..=b'9') = self.peek() {
            self.i += 1;
        }
    }

    fn some_digits(&mut self) -> Option<()> {
        let start = self.i;
        self.digits();
        (self.i > start).then_some(())
    }
}

/// Where the run of a string's plain text that starts at `i` ends: at its
/// closing quote, an escape or a control character (not allowed raw), or at
/// the end of `b`. Eight bytes at a time: the strings of a chunk are short,
/// and a byte loop or a vectorised search would cost more than the rest of
/// the scan.
fn plain_run(b: &[u8], mut i: usize) -> usize {
    const ONES: u64 = u64::from_le_bytes([1; 8]);
    const HIGHS: u64 = ONES * 0x80;
    // A byte of `x` below `n` (n <= 128) sets the high bit of its byte in
    // `(x - n * ONES) & !x & HIGHS`. Bytes above the first such byte may be
    // set too (the borrow), so only the lowest one is read.
    let below = |x: u64, n: u8| x.wrapping_sub(ONES * u64::from(n)) & !x & HIGHS;
    while let Some(word) = b.get(i..i + 8) {
        let mut bytes = [0; 8];
        bytes.copy_from_slice(word);
        let x = u64::from_le_bytes(bytes);
        let stops = below(x ^ (ONES * u64::from(b'"')), 1)
            | below(x ^ (ONES * u64::from(b'\\')), 1)
            | below(x, 0x20);
        if stops != 0 {
            return i + (stops.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    while b
        .get(i)
        .is_some_and(|&c| c != b'"' && c != b'\\' && c >= 0x20)
    {
        i += 1;
    }
    i
}

/// Marks a field seen; `None` the second time (serde refuses a repeated
/// field it reads).
fn once(seen: &mut bool) -> Option<()> {
    (!std::mem::replace(seen, true)).then_some(())
}

#[cfg(test)]
mod tests {
    use super::super::read_chunk;
    use super::*;

    /// The scan and serde agree wherever the scan answers.
    fn agrees(data: &str) -> bool {
        chunk(data.as_bytes()).is_none_or(|c| c == read_chunk(data))
    }

    #[test]
    fn the_common_chunks_are_read_by_the_scan() {
        let cases = [
            (
                r#"{"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"tok é"},"logprobs":null,"finish_reason":null}],"usage":null}"#,
                Chunk::Content { finished: false },
            ),
            (
                r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#,
                Chunk::NoContent { finished: false },
            ),
            (
                r#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#,
                Chunk::NoContent { finished: true },
            ),
            (
                r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"a\":1}"}}]}}]}"#,
                Chunk::Content { finished: false },
            ),
            (
                r#"{"choices":[{"delta":{"content":"a\nb \u00e9"},"finish_reason":"length"}]}"#,
                Chunk::Content { finished: true },
            ),
            (
                r#" { "choices" : [ ] , "usage" : { "prompt_tokens" : 5 , "x" : [ 1.5e3 , -0 , true ] } } "#,
                Chunk::NoContent { finished: false },
            ),
            (
                r#"{"choices":[{"delta":{"tool_calls":[],"refusal":null,"reasoning_content":"r"}}],"error":null}"#,
                Chunk::Content { finished: false },
            ),
        ];
        for (data, want) in cases {
            assert_eq!(chunk(data.trim().as_bytes()), Some(want), "{data}");
            assert_eq!(read_chunk(data.trim()), want, "{data}");
        }
    }

    #[test]
    fn what_serde_reads_differently_is_left_to_it() {
        for data in [
            r#"{"error":{"message":"slow down","code":429}}"#,
            r#"{"choices":[],"choices":[]}"#,
            r#"{"cho\u0069ces":[{"delta":{"content":"x"}}]}"#,
            r#"{"choices":[{"delta":{"content":"x","content":"y"}}]}"#,
            r#"{"choices":[{"delta":{"content":5}}]}"#,
            r#"{"choices":[{"delta":["x"]}]}"#,
            r#"{"choices":null}"#,
            r#"{"choices":[{"delta":{"content":"\ud83d\ude00"}}]}"#,
            r#"{"choices":[{"delta":{"content":"a	tab"}}]}"#,
            r#"{"choices":[],}"#,
            r#"{"choices":[01]}"#,
            r#"{"x":1.}"#,
            r#"{"x":"\x"}"#,
            r#"["choices"]"#,
            r#"{"choices":[]} x"#,
        ] {
            assert_eq!(chunk(data.as_bytes()), None, "{data}");
        }
        let deep = format!("{{\"x\":{}1{}}}", "[".repeat(120), "]".repeat(120));
        assert_eq!(chunk(deep.as_bytes()), None);
    }

    #[test]
    fn a_plain_run_ends_at_the_first_quote_escape_or_control_character() {
        let naive = |b: &[u8], i: usize| {
            (i..b.len())
                .find(|&j| matches!(b[j], b'"' | b'\\' | 0..0x20))
                .unwrap_or(b.len())
        };
        let fillers: [&[u8]; 3] = [b"a", "é".as_bytes(), b"\x7f"];
        for len in 0..24 {
            for filler in fillers {
                let text: Vec<u8> = filler.iter().copied().cycle().take(len).collect();
                assert_eq!(plain_run(&text, 0), len);
                for at in 0..len {
                    for stop in [b'"', b'\\', 0, b'\n', 0x1f] {
                        let mut b = text.clone();
                        b[at] = stop;
                        if at + 1 < len {
                            b[at + 1] = b'"';
                        }
                        for from in 0..=at {
                            assert_eq!(plain_run(&b, from), naive(&b, from), "{b:?} from {from}");
                        }
                    }
                }
            }
        }
    }

    /// Seeded xorshift: the same inputs on every run.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: usize) -> usize {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            usize::try_from(self.0 % n as u64).unwrap_or(0)
        }

        fn pick<'a>(&mut self, from: &[&'a str]) -> &'a str {
            from[self.below(from.len())]
        }
    }

    const LEAVES: &[&str] = &[
        r#""""#,
        r#""hi""#,
        r#""a\"b""#,
        r#""\u00e9""#,
        "null",
        "true",
        "false",
        "0",
        "-1.5e-3",
        "[]",
        "[ ]",
        "{}",
        r#"[1,"x",null]"#,
        r#"{"a":[{}]}"#,
    ];
    const BROKEN_LEAVES: &[&str] = &[r#""\ud83d\ude00""#, r#""\q""#, "01", "1.", "é", "nul"];

    /// A leaf value, now and then one serde refuses or reads its own way.
    fn leaf(rng: &mut Rng) -> String {
        let from = if rng.below(30) == 0 {
            BROKEN_LEAVES
        } else {
            LEAVES
        };
        rng.pick(from).to_owned()
    }

    const DELTA_KEYS: &[&str] = &[
        "content",
        "refusal",
        "reasoning_content",
        "tool_calls",
        "function_call",
        "role",
        r"cont\u0065nt",
    ];

    fn object(
        rng: &mut Rng,
        keys: &[&str],
        value: &mut dyn FnMut(&mut Rng, &str) -> String,
    ) -> String {
        let members: Vec<String> = (0..rng.below(5))
            .map(|_| {
                let key = rng.pick(keys);
                let ws = rng.pick(&["", " ", "\n"]);
                format!("{ws}\"{key}\"{ws}:{ws}{}", value(rng, key))
            })
            .collect();
        format!("{{{}}}", members.join(","))
    }

    fn generated(rng: &mut Rng) -> String {
        let mut delta = |rng: &mut Rng, _: &str| leaf(rng);
        let mut choice = |rng: &mut Rng, key: &str| match (key, rng.below(4)) {
            ("delta", 0..=2) => object(rng, DELTA_KEYS, &mut delta),
            _ => leaf(rng),
        };
        let mut top = |rng: &mut Rng, key: &str| match (key, rng.below(5)) {
            ("choices", 0..=3) => {
                let choices: Vec<String> = (0..rng.below(3))
                    .map(|_| object(rng, &["delta", "finish_reason", "index"], &mut choice))
                    .collect();
                format!("[{}]", choices.join(","))
            }
            ("error", 0) => r#"{"code":503}"#.to_owned(),
            _ => leaf(rng),
        };
        object(
            rng,
            &["choices", "choices", "error", "id", "usage"],
            &mut top,
        )
    }

    /// Takes out, doubles or replaces one byte of an ASCII-only text.
    fn mutated(rng: &mut Rng, data: &str) -> Option<String> {
        let mut bytes = data.as_bytes().to_vec();
        let at = rng.below(bytes.len().max(1));
        let byte = *rng
            .pick(&[
                "{", "}", "[", "]", "\"", ",", ":", "\\", "0", "n", " ", "\t",
            ])
            .as_bytes()
            .first()?;
        match rng.below(3) {
            0 if at < bytes.len() => drop(bytes.remove(at)),
            1 => bytes.insert(at, byte),
            _ if at < bytes.len() => bytes[at] = byte,
            _ => {}
        }
        String::from_utf8(bytes).ok()
    }

    #[test]
    fn on_generated_and_mutated_chunks_the_scan_agrees_with_serde() {
        let mut rng = Rng(0x5EED_1234_ABCD_0001);
        let (mut answered, mut tried) = (0, 0);
        for _ in 0..20_000 {
            let data = generated(&mut rng);
            for data in [Some(data.clone()), mutated(&mut rng, &data)]
                .into_iter()
                .flatten()
            {
                tried += 1;
                answered += usize::from(chunk(data.as_bytes()).is_some());
                assert!(agrees(&data), "scan and serde disagree on {data}");
            }
        }
        // Not a scan that always steps aside.
        assert!(
            answered * 4 > tried,
            "the scan answered {answered} of {tried}"
        );
    }
}
