//! containerd's filter syntax, as `List` (Walk) gets it: a list of
//! filters, any of which may match; each a comma-separated list of
//! selectors, all of which must; a selector is a field path
//! (`name`, `parent`, `kind`, `labels.KEY`, components quoted with `"`
//! where they hold other characters), alone (the field is present) or
//! with `==`, `!=` or `~=` (a regular expression) and a value (bare or
//! quoted).

use std::collections::HashMap;

#[derive(Debug)]
enum Op {
    Present,
    Eq(String),
    Ne(String),
    Re(regex::Regex),
}

#[derive(Debug)]
struct Selector {
    path: Vec<String>,
    op: Op,
}

/// A filter that does not parse, and why.
#[derive(Debug, thiserror::Error)]
#[error("filter {filter:?}: {why}")]
pub struct FilterError {
    pub filter: String,
    pub why: Why,
}

/// What is wrong with a filter.
#[derive(Debug, thiserror::Error)]
pub enum Why {
    #[error("not UTF-8")]
    NotUtf8,
    #[error("an unterminated quote")]
    Unterminated,
    #[error("a field name expected at byte {0}")]
    FieldExpected(usize),
    #[error("bad regular expression {0:?}: {1}")]
    BadRegex(String, regex::Error),
    #[error("unexpected {0:?} at byte {1}")]
    Unexpected(char, usize),
}

/// Parsed filters: matches if any of its alternatives does.
#[derive(Debug, Default)]
pub struct Filter(Vec<Vec<Selector>>);

/// The fields a filter looks at.
pub struct Fields<'a> {
    pub name: &'a str,
    pub parent: &'a str,
    pub kind: &'a str,
    pub labels: &'a HashMap<String, String>,
}

impl Filter {
    pub fn parse(filters: &[String]) -> Result<Filter, FilterError> {
        let mut alts = Vec::new();
        for f in filters.iter().filter(|f| !f.trim().is_empty()) {
            alts.push(parse_one(f).map_err(|why| FilterError { filter: f.clone(), why })?);
        }
        Ok(Filter(alts))
    }

    pub fn matches(&self, f: &Fields<'_>) -> bool {
        self.0.is_empty() || self.0.iter().any(|sels| sels.iter().all(|s| s.matches(f)))
    }
}

impl Selector {
    fn matches(&self, f: &Fields<'_>) -> bool {
        let value: Option<&str> = match self.path.first().map(String::as_str) {
            Some("name") if self.path.len() == 1 => Some(f.name),
            Some("parent") if self.path.len() == 1 => Some(f.parent),
            Some("kind") if self.path.len() == 1 => Some(f.kind),
            Some("labels") if self.path.len() == 2 => f.labels.get(&self.path[1]).map(String::as_str),
            _ => None,
        };
        match &self.op {
            Op::Present => value.is_some_and(|v| !v.is_empty()),
            Op::Eq(want) => value == Some(want.as_str()),
            Op::Ne(want) => value != Some(want.as_str()),
            Op::Re(re) => value.is_some_and(|v| re.is_match(v)),
        }
    }
}

struct Lexer<'a> {
    s: &'a [u8],
    i: usize,
}

impl Lexer<'_> {
    fn skip_ws(&mut self) {
        while self.i < self.s.len() && self.s[self.i].is_ascii_whitespace() {
            self.i += 1;
        }
    }
    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }
    fn eat(&mut self, t: &str) -> bool {
        if self.s[self.i..].starts_with(t.as_bytes()) {
            self.i += t.len();
            true
        } else {
            false
        }
    }
    fn quoted(&mut self) -> Result<String, Why> {
        let q = self.s[self.i];
        self.i += 1;
        let mut out = Vec::new();
        while let Some(c) = self.peek() {
            self.i += 1;
            if c == q {
                return String::from_utf8(out).map_err(|_| Why::NotUtf8);
            }
            if c == b'\\' {
                if let Some(n) = self.peek() {
                    self.i += 1;
                    out.push(n);
                    continue;
                }
            }
            out.push(c);
        }
        Err(Why::Unterminated)
    }
    fn field(&mut self) -> Result<String, Why> {
        self.skip_ws();
        match self.peek() {
            Some(b'"') => self.quoted(),
            _ => {
                let start = self.i;
                while self
                    .peek()
                    .is_some_and(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-' || c == b'/')
                {
                    self.i += 1;
                }
                if start == self.i {
                    return Err(Why::FieldExpected(self.i));
                }
                Ok(String::from_utf8_lossy(&self.s[start..self.i]).into_owned())
            }
        }
    }
    fn value(&mut self) -> Result<String, Why> {
        self.skip_ws();
        match self.peek() {
            Some(b'"') | Some(b'\'') | Some(b'/') => self.quoted(),
            _ => {
                let start = self.i;
                while self.peek().is_some_and(|c| c != b',') {
                    self.i += 1;
                }
                Ok(String::from_utf8_lossy(&self.s[start..self.i]).trim().to_string())
            }
        }
    }
}

fn parse_one(f: &str) -> Result<Vec<Selector>, Why> {
    let mut l = Lexer { s: f.as_bytes(), i: 0 };
    let mut out = Vec::new();
    loop {
        let mut path = vec![l.field()?];
        while l.eat(".") {
            path.push(l.field()?);
        }
        l.skip_ws();
        let op = if l.eat("==") {
            Op::Eq(l.value()?)
        } else if l.eat("!=") {
            Op::Ne(l.value()?)
        } else if l.eat("~=") {
            let v = l.value()?;
            Op::Re(regex::Regex::new(&v).map_err(|e| Why::BadRegex(v.clone(), e))?)
        } else {
            Op::Present
        };
        out.push(Selector { path, op });
        l.skip_ws();
        match l.peek() {
            None => return Ok(out),
            Some(b',') => l.i += 1,
            Some(c) => return Err(Why::Unexpected(c as char, l.i)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors() {
        let mut labels = HashMap::new();
        labels.insert("containerd.io/gc.root".to_string(), "x".to_string());
        let f = Fields {
            name: "default/1/sha256:ab",
            parent: "",
            kind: "committed",
            labels: &labels,
        };
        let m = |s: &[&str]| {
            Filter::parse(&s.iter().map(|x| x.to_string()).collect::<Vec<_>>())
                .unwrap()
                .matches(&f)
        };
        assert!(m(&[]));
        assert!(m(&["kind==committed"]));
        assert!(!m(&["kind==active"]));
        assert!(m(&["kind==active", "name~=sha256"]));
        assert!(m(&[r#"labels."containerd.io/gc.root""#]));
        assert!(!m(&[r#"labels."containerd.io/other""#]));
        assert!(m(&["kind==committed,parent!=x"]));
        assert!(!m(&["kind==committed,parent"]));
        assert!(Filter::parse(&["kind~=(".to_string()]).is_err());
    }
}
