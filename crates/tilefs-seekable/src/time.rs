//! RFC 3339 timestamps, as Go writes `time.Time` into the tables of
//! contents (eStargz: whole seconds; zstd:chunked: nanoseconds).

use crate::error::{Error, Result};

/// Seconds and nanoseconds since the Unix epoch, UTC.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp {
    pub secs: i64,
    pub nanos: u32,
}

/// Parses `YYYY-MM-DDTHH:MM:SS[.fraction](Z|±HH:MM)`, years 0000-9999 (what
/// Go's encoder can write), every field in its range.
pub fn parse_rfc3339(s: &str) -> Result<Timestamp> {
    let bad = || Error::toc(format!("{:?} is not an RFC 3339 time", crate::digest::truncate(s)));
    let b = s.as_bytes();
    let num = |at: usize, len: usize| -> Result<i64> {
        let digits = b.get(at..at + len).ok_or_else(bad)?;
        if !digits.iter().all(u8::is_ascii_digit) {
            return Err(bad());
        }
        Ok(digits.iter().fold(0i64, |n, d| n * 10 + i64::from(d - b'0')))
    };
    let sep = |at: usize, c: u8| if b.get(at) == Some(&c) { Ok(()) } else { Err(bad()) };
    let (year, month, day) = (num(0, 4)?, num(5, 2)?, num(8, 2)?);
    sep(4, b'-')?;
    sep(7, b'-')?;
    sep(10, b'T')?;
    let (hour, min, sec) = (num(11, 2)?, num(14, 2)?, num(17, 2)?);
    sep(13, b':')?;
    sep(16, b':')?;
    if !(1..=12).contains(&month) || day < 1 || day > days_in_month(year, month) || hour > 23 || min > 59 || sec > 59 {
        return Err(bad());
    }
    let mut at = 19;
    let mut nanos = 0u32;
    if b.get(at) == Some(&b'.') {
        let digits = b[at + 1..].iter().take_while(|c| c.is_ascii_digit()).count();
        if digits == 0 || digits > 9 {
            return Err(bad());
        }
        nanos = num(at + 1, digits)? as u32 * 10u32.pow(9 - digits as u32);
        at += 1 + digits;
    }
    let offset = match b.get(at) {
        Some(b'Z') if b.len() == at + 1 => 0,
        Some(&sign @ (b'+' | b'-')) if b.len() == at + 6 => {
            sep(at + 3, b':')?;
            let (oh, om) = (num(at + 1, 2)?, num(at + 4, 2)?);
            if oh > 23 || om > 59 {
                return Err(bad());
            }
            let o = oh * 3600 + om * 60;
            if sign == b'-' {
                -o
            } else {
                o
            }
        }
        _ => return Err(bad()),
    };
    let secs = days_from_civil(year, month, day) * 86400 + hour * 3600 + min * 60 + sec - offset;
    Ok(Timestamp { secs, nanos })
}

fn days_in_month(y: i64, m: i64) -> i64 {
    match m {
        2 if (y % 4 == 0 && y % 100 != 0) || y % 400 == 0 => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days from 1970-01-01 to a proleptic Gregorian date (years ≥ 0).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    // March-based years put the leap day last; eras of 400 years repeat.
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146097 + doe - 719468
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> (i64, u32) {
        let ts = parse_rfc3339(s).unwrap();
        (ts.secs, ts.nanos)
    }

    #[test]
    fn known_instants() {
        assert_eq!(t("1970-01-01T00:00:00Z"), (0, 0));
        assert_eq!(t("2009-02-13T23:31:30Z"), (1234567890, 0));
        assert_eq!(t("2024-02-29T12:00:00.5+01:00"), (1709204400, 500_000_000));
        assert_eq!(t("1969-12-31T23:59:59.000000001Z"), (-1, 1));
        assert_eq!(t("0000-01-01T00:00:00Z"), (-62167219200, 0));
        assert_eq!(t("9999-12-31T23:59:59-23:59"), (253402300799 + 86340, 0));
    }

    #[test]
    fn refuses_what_is_not_rfc3339() {
        for s in [
            "",
            "2023-02-29T00:00:00Z",
            "2023-13-01T00:00:00Z",
            "2023-01-01 00:00:00Z",
            "2023-01-01T24:00:00Z",
            "2023-01-01T00:00:60Z",
            "2023-01-01T00:00:00",
            "2023-01-01T00:00:00.Z",
            "2023-01-01T00:00:00.0123456789Z",
            "2023-01-01T00:00:00+0100",
            "2023-01-01T00:00:00Zx",
            "+2023-01-01T00:00:00Z",
            "2023-01-01T00:00:00z",
        ] {
            assert!(parse_rfc3339(s).is_err(), "{s}");
        }
    }
}
