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
//!
//! The chunks of one stream differ mostly in the text of a few strings (the
//! delta, an `obfuscation` pad), so a [`Memo`] of the last chunk scanned whole
//! reads the next one by comparing it with that one and checking only what
//! changed.

use super::Chunk;

/// serde_json stops at 128 levels; staying well below keeps the two readings
/// equal.
const MAX_DEPTH: u32 = 100;

/// Chunks longer than this are not kept by a [`Memo`] (it lives as long as
/// its stream).
const MEMO_MAX_BYTES: usize = 4096;

/// The chunk's meaning, or `None` when serde must read it.
pub(super) fn chunk(data: &[u8]) -> Option<Chunk> {
    Scan::new(data, None).read().map(Facts::chunk)
}

/// The raw values of `keys` in the JSON object `data` (`None` for a key it
/// lacks), the whole object validated as serde_json reads it. `None` when
/// serde must read it instead: not one object, a key with an escape, or a
/// wanted key twice (serde refuses a repeated field it reads). Each value is
/// a slice of `data` (a value starts and ends on an ASCII byte).
#[must_use]
pub fn fields<'a, const N: usize>(data: &'a str, keys: [&str; N]) -> Option<[Option<&'a str>; N]> {
    let mut out = [None; N];
    let mut s = Scan::new(data.as_bytes(), None);
    s.eat(b'{')?;
    s.members(|s, key| {
        let key = key?;
        let Some(at) = keys.iter().position(|k| k.as_bytes() == key) else {
            return s.value(1);
        };
        let start = s.i;
        s.value(1)?;
        match out[at] {
            Some(_) => None,
            None => {
                out[at] = Some(data.get(start..s.i)?);
                Some(())
            }
        }
    })?;
    s.ws();
    (s.i == data.len()).then_some(out)
}

/// Whether `text` between quotes is a JSON string read as it is: no quote,
/// escape or control character in it.
#[must_use]
pub fn is_plain(text: &str) -> bool {
    plain_run(text.as_bytes(), 0) == text.len()
}

/// The length of `text`'s first run without a quote, a backslash or a
/// control character: a JSON string's text up to where it ends or needs
/// reading as JSON.
#[must_use]
pub fn plain_len(text: &str) -> usize {
    plain_run(text.as_bytes(), 0)
}

/// A field [`fields`] read, as serde reads an `Option<&str>`: absent or
/// `null` is `Some(None)`; a string without an escape is its text; anything
/// else (an escape, another type) is `None`, for serde to judge.
#[must_use]
pub fn plain_str(raw: Option<&str>) -> Option<Option<&str>> {
    match raw {
        None | Some("null") => Some(None),
        Some(raw) => {
            let text = raw.strip_prefix('"')?.strip_suffix('"')?;
            // A validated string: without an escape, its text is as it is.
            (!text.contains('\\')).then_some(Some(text))
        }
    }
}

/// A field [`fields`] read, as serde reads an `Option<u64>`: absent or
/// `null` is `Some(None)`; `None` for anything but digits that fit.
#[must_use]
pub fn plain_u64(raw: Option<&str>) -> Option<Option<u64>> {
    match raw {
        None | Some("null") => Some(None),
        Some(raw) => {
            // A validated number: digits alone are an unsigned integer.
            if !raw.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            raw.parse().ok().map(Some)
        }
    }
}

/// The last chunk of a stream the scan read whole, with where its value
/// strings lie.
#[derive(Debug, Default)]
pub(super) struct Memo {
    /// Empty when the last chunk was not read by the scan (or none came yet):
    /// a chunk never is.
    last: Vec<u8>,
    strings: Vec<Span>,
    facts: Facts,
    /// Chunks read by their difference from `last`.
    #[cfg(test)]
    pub(super) by_difference: usize,
}

impl Memo {
    /// [`chunk`], for the next chunk of the stream this memo has seen.
    pub(super) fn chunk(&mut self, data: &[u8]) -> Option<Chunk> {
        if let Some(facts) = self.same_shape(data) {
            #[cfg(test)]
            {
                self.by_difference += 1;
            }
            return Some(facts.chunk());
        }
        self.last.clear();
        if data.len() > MEMO_MAX_BYTES {
            return chunk(data);
        }
        self.strings.clear();
        let facts = Scan::new(data, Some(&mut self.strings)).read()?;
        self.last.extend_from_slice(data);
        self.facts = facts;
        Some(facts.chunk())
    }

    /// The facts of `b` when it is the last chunk with only the text of
    /// some value strings changed: walking both, every difference must start
    /// inside a value string of the last chunk (read plain, no escape) and
    /// run to its closing quote, and in `b` be plain text up to a closing
    /// quote. Then `b` has the last chunk's structure, keys and types, and
    /// only a text field's emptiness can change what it means.
    fn same_shape(&self, b: &[u8]) -> Option<Facts> {
        let a = &self.last[..];
        if a.is_empty() {
            return None;
        }
        let mut facts = self.facts;
        let mut strings = self.strings.iter();
        let (mut i, mut j) = (0, 0);
        loop {
            let same = common_prefix(&a[i..], &b[j..]);
            i += same;
            j += same;
            if i == a.len() && j == b.len() {
                return Some(facts);
            }
            let string = strings.find(|s| s.end >= i)?;
            if string.start > i {
                return None;
            }
            // Where `b`'s plain text stops must be its closing quote: the
            // walk goes on from `a`'s, and a quote is no string's text.
            let close = plain_run(b, j);
            if string.text {
                let was = string.end > string.start;
                let now = i > string.start || close > j;
                facts.texts = facts.texts - u32::from(was) + u32::from(now);
            }
            i = string.end;
            j = close;
        }
    }
}

/// Where a value string's text lies (between its quotes).
#[derive(Debug, Clone, Copy)]
struct Span {
    start: usize,
    end: usize,
    /// A delta's text field: whether it is empty is part of the meaning.
    text: bool,
}

#[derive(Debug, Default, Clone, Copy)]
struct Facts {
    /// Content other than the text fields read plain: a tool or function
    /// call, a text with an escape.
    elsewhere: bool,
    /// Text fields read plain that are not empty.
    texts: u32,
    finished: bool,
}

impl Facts {
    fn chunk(self) -> Chunk {
        let finished = self.finished;
        if self.elsewhere || self.texts > 0 {
            Chunk::Content { finished }
        } else {
            Chunk::NoContent { finished }
        }
    }
}

struct Scan<'a, 's> {
    b: &'a [u8],
    i: usize,
    /// Where the value strings read plain are, when a memo keeps them.
    strings: Option<&'s mut Vec<Span>>,
}

impl<'a, 's> Scan<'a, 's> {
    fn new(b: &'a [u8], strings: Option<&'s mut Vec<Span>>) -> Self {
        Scan { b, i: 0, strings }
    }

    /// The whole of `b`: one object, nothing after it.
    fn read(mut self) -> Option<Facts> {
        let facts = self.top()?;
        self.ws();
        (self.i == self.b.len()).then_some(facts)
    }

    /// Keeps where a plain value string's text lies.
    fn record(&mut self, start: usize, text: bool) {
        if let Some(strings) = &mut self.strings {
            strings.push(Span {
                start,
                end: self.i - 1,
                text,
            });
        }
    }

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
        let mut seen = [false; 6];
        self.members(|s, key| {
            let field = match key? {
                b"content" => 0,
                b"refusal" => 1,
                b"reasoning_content" => 2,
                // vLLM's and OpenRouter's name for it.
                b"reasoning" => 3,
                b"tool_calls" => 4,
                b"function_call" => 5,
                _ => return s.value(4),
            };
            once(&mut seen[field])?;
            if field >= 4 {
                let raw = s.raw_value(4)?;
                facts.elsewhere |= raw != b"null" && raw != b"[]";
                return Some(());
            }
            // Text fields: a string or null, as serde's `Option<Cow<str>>`.
            if s.peek()? == b'n' {
                return s.literal(b"null");
            }
            s.eat(b'"')?;
            let start = s.i;
            match s.string()? {
                Some(text) => {
                    s.record(start, true);
                    facts.texts += u32::from(!text.is_empty());
                }
                None => facts.elsewhere = true,
            }
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
                let start = self.i;
                if self.string()?.is_some() {
                    self.record(start, false);
                }
                Some(())
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

/// How many bytes `a` and `b` start with alike, eight at a time.
fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + 8 <= n {
        let (mut x, mut y) = ([0; 8], [0; 8]);
        x.copy_from_slice(&a[i..i + 8]);
        y.copy_from_slice(&b[i..i + 8]);
        let differ = u64::from_le_bytes(x) ^ u64::from_le_bytes(y);
        if differ != 0 {
            return i + (differ.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    while i < n && a[i] == b[i] {
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
        "reasoning",
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

    /// What a memo reads, checked against a stateless read of the same data.
    fn read_with(memo: &mut Memo, data: &str) -> Option<Chunk> {
        let read = memo.chunk(data.as_bytes());
        assert_eq!(
            read,
            chunk(data.as_bytes()),
            "memo and scan differ on {data}"
        );
        read
    }

    #[test]
    fn a_streams_chunks_are_read_by_their_difference() {
        let chunk_of = |delta: &str, finish: &str, pad: &str| {
            format!(
                r#"{{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{{"index":0,"delta":{delta},"logprobs":null,"finish_reason":{finish}}}],"obfuscation":"{pad}"}}"#
            )
        };
        let mut memo = Memo::default();
        let stream = [
            (
                chunk_of(r#"{"role":"assistant","content":""}"#, "null", "x1"),
                Chunk::NoContent { finished: false },
            ),
            (
                chunk_of(r#"{"content":"Hel"}"#, "null", "abcdef"),
                Chunk::Content { finished: false },
            ),
            (
                chunk_of(r#"{"content":"lo, wörld"}"#, "null", "Z"),
                Chunk::Content { finished: false },
            ),
            (
                chunk_of(r#"{"content":""}"#, "null", "pad"),
                Chunk::NoContent { finished: false },
            ),
            (
                chunk_of(r#"{"content":"again"}"#, "null", ""),
                Chunk::Content { finished: false },
            ),
            (
                chunk_of(r#"{"content":"a\"quote"}"#, "null", "q"),
                Chunk::Content { finished: false },
            ),
            (
                chunk_of(r#"{"content":"b"}"#, "null", "q"),
                Chunk::Content { finished: false },
            ),
            (
                chunk_of("{}", r#""stop""#, "end"),
                Chunk::NoContent { finished: true },
            ),
        ];
        for (data, want) in &stream {
            assert_eq!(read_with(&mut memo, data), Some(*want), "{data}");
        }
        // Read whole: the first, the one after the role chunk (another key),
        // the escaped text, the one after it (its string had an escape), the
        // finish. The rest by their difference.
        assert_eq!(memo.by_difference, 3);
    }

    #[test]
    fn a_difference_outside_a_strings_text_is_read_whole() {
        let mut memo = Memo::default();
        let base = r#"{"choices":[{"delta":{"content":"ab","role":"assistant"},"finish_reason":null}],"n":1}"#;
        read_with(&mut memo, base);
        let content = Some(Chunk::Content { finished: false });
        for (data, want, by_difference) in [
            // Text only.
            (r#"{"choices":[{"delta":{"content":"","role":"assistant"},"finish_reason":null}],"n":1}"#, Some(Chunk::NoContent { finished: false }), true),
            (r#"{"choices":[{"delta":{"content":"abc","role":"tool"},"finish_reason":null}],"n":1}"#, content, true),
            // A key, a number, a literal, a quote or an escape in the text,
            // text running out of its string, a control character, what
            // follows the object, a cut.
            (r#"{"choices":[{"delta":{"contenu":"ab","role":"assistant"},"finish_reason":null}],"n":1}"#, Some(Chunk::NoContent { finished: false }), false),
            (r#"{"choices":[{"delta":{"content":"ab","role":"assistant"},"finish_reason":null}],"n":2}"#, content, false),
            (r#"{"choices":[{"delta":{"content":"ab","role":"assistant"},"finish_reason":"stop"}],"n":1}"#, Some(Chunk::Content { finished: true }), false),
            (r#"{"choices":[{"delta":{"content":"a"b","role":"assistant"},"finish_reason":null}],"n":1}"#, None, false),
            (r#"{"choices":[{"delta":{"content":"a\nb","role":"assistant"},"finish_reason":null}],"n":1}"#, content, false),
            (r#"{"choices":[{"delta":{"content":"ab","x":"y","role":"assistant"},"finish_reason":null}],"n":1}"#, content, false),
            ("{\"choices\":[{\"delta\":{\"content\":\"a\u{1}b\",\"role\":\"assistant\"},\"finish_reason\":null}],\"n\":1}", None, false),
            (r#"{"choices":[{"delta":{"content":"ab","role":"assistant"},"finish_reason":null}],"n":1} "#, content, false),
            (r#"{"choices":[{"delta":{"content":"ab","role":"assistant"},"finish_reason":null}],"n":1}x"#, None, false),
            (r#"{"choices":[{"delta":{"content":"ab","role":"assistant"},"finish_reason":null}],"n":1"#, None, false),
        ] {
            let before = memo.by_difference;
            assert_eq!(read_with(&mut memo, data), want, "{data}");
            assert_eq!(memo.by_difference > before, by_difference, "{data}");
            // The next case is compared with `base` again.
            read_with(&mut memo, base);
        }
    }

    /// Replaces the text of the `n`th string of `data` (keys included) with
    /// `text`.
    fn with_string(data: &str, n: usize, text: &str) -> String {
        let mut quotes = data.match_indices('"').map(|(i, _)| i);
        let Some(open) = quotes.nth(2 * n) else {
            return data.to_owned();
        };
        let Some(close) = quotes.next() else {
            return data.to_owned();
        };
        format!("{}{text}{}", &data[..=open], &data[close..])
    }

    #[test]
    fn on_generated_streams_the_memo_agrees_with_the_scan() {
        let mut rng = Rng(0x5EED_1234_ABCD_0002);
        let texts = [
            "",
            "a",
            "tok é",
            "x y z 12345678",
            "a\\\"b",
            "\\u0041",
            "\\",
            "\"",
            "a\tb",
        ];
        let mut by_difference = 0;
        for _ in 0..4_000 {
            let mut memo = Memo::default();
            let base = generated(&mut rng);
            read_with(&mut memo, &base);
            for _ in 0..6 {
                let n = rng.below(12);
                let text = rng.pick(&texts);
                let next = with_string(&base, n, text);
                let next = match rng.below(4) {
                    0 => mutated(&mut rng, &next).unwrap_or(next),
                    _ => next,
                };
                let read = memo.by_difference;
                let agreed = read_with(&mut memo, &next).is_none_or(|c| c == read_chunk(&next));
                assert!(agreed, "memo and serde disagree on {next}");
                by_difference += memo.by_difference - read;
            }
        }
        // Not a memo that always reads whole.
        assert!(
            by_difference > 4_000,
            "read by difference {by_difference} times"
        );
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
