//! Cron expressions (the five fields of crontab(5): minute, hour, day of month, month, day of
//! week) and their occurrences in a time zone.
//!
//! Each field is `*`, a value, a range `a-b`, a step `*/n`, `a-b/n` or `a/n`, or a list of
//! those separated by commas; months and weekdays may be named (`jan`, `mon`), and weekday 7 is
//! Sunday as 0 is. The macros `@yearly` (`@annually`), `@monthly`, `@weekly`, `@daily`
//! (`@midnight`) and `@hourly` stand for their usual expressions. As in Vixie cron, when both
//! the day of month and the day of week are restricted (neither is `*`), a day matches when
//! either does.
//!
//! Times are civil times in the schedule's zone. A time that a daylight-saving change skips
//! happens at the first instant after the gap; a time that happens twice happens at the first
//! of the two. Searches are bounded: an occurrence is looked for within [`SEARCH_DAYS`] days,
//! and an expression that can never fire (`0 0 30 2 *`) is refused when parsed.

use jiff::Timestamp;
use jiff::civil::{Date, DateTime};
use jiff::tz::TimeZone;

/// How many days a search for the next or the latest occurrence looks through: eight years
/// and a day, so that a February 29 between two leap years eight years apart (2096 and 2104)
/// is still found.
pub const SEARCH_DAYS: u32 = 8 * 366 + 1;

/// How far a daylight-saving change can move a civil time: searches start this far before
/// (or after) the civil time they search from.
const DST_MARGIN: jiff::SignedDuration = jiff::SignedDuration::from_hours(3);

/// A parsed cron expression.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cron {
    text: String,
    minutes: u64,
    hours: u64,
    days: u64,
    months: u64,
    weekdays: u64,
    /// Whether the day-of-month field is `*` (then only the weekday decides a day).
    any_day: bool,
    /// Whether the day-of-week field is `*` (then only the day of month decides a day).
    any_weekday: bool,
}

const MONTHS: [&str; 12] = [
    "jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec",
];
const WEEKDAYS: [&str; 7] = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"];

/// One of the five fields: its name in messages, its bounds and its value names.
struct Field {
    name: &'static str,
    min: u32,
    max: u32,
    names: &'static [&'static str],
}

const FIELDS: [Field; 5] = [
    Field {
        name: "minute",
        min: 0,
        max: 59,
        names: &[],
    },
    Field {
        name: "hour",
        min: 0,
        max: 23,
        names: &[],
    },
    Field {
        name: "day of month",
        min: 1,
        max: 31,
        names: &[],
    },
    Field {
        name: "month",
        min: 1,
        max: 12,
        names: &MONTHS,
    },
    Field {
        name: "day of week",
        min: 0,
        max: 7,
        names: &WEEKDAYS,
    },
];

impl Field {
    fn value(&self, text: &str) -> Result<u32, String> {
        let lower = text.to_ascii_lowercase();
        if let Some(i) = self.names.iter().position(|n| *n == lower) {
            // Month names count from 1, weekday names from 0 (Sunday).
            let i = u32::try_from(i).unwrap_or(0);
            return Ok(i + self.min.min(1));
        }
        let v: u32 = text.parse().map_err(|_| {
            format!(
                "{} field: {text:?} is not a number{}",
                self.name,
                if self.names.is_empty() {
                    String::new()
                } else {
                    format!(" or a name ({})", self.names.join(", "))
                }
            )
        })?;
        if v < self.min || v > self.max {
            return Err(format!(
                "{} field: {v} is out of range {}-{}",
                self.name, self.min, self.max
            ));
        }
        Ok(v)
    }

    /// The set of values `text` names, as a bit mask.
    fn parse(&self, text: &str) -> Result<u64, String> {
        let mut mask = 0u64;
        for part in text.split(',') {
            let (range, step) = match part.split_once('/') {
                Some((r, s)) => {
                    let step: u32 = s.parse().ok().filter(|s| *s > 0).ok_or_else(|| {
                        format!(
                            "{} field: step {s:?} is not a whole number above 0",
                            self.name
                        )
                    })?;
                    (r, Some(step))
                }
                None => (part, None),
            };
            let (lo, hi) = if range == "*" {
                (self.min, self.max)
            } else if let Some((a, b)) = range.split_once('-') {
                let (a, b) = (self.value(a)?, self.value(b)?);
                if a > b {
                    return Err(format!(
                        "{} field: range {range:?} runs backwards",
                        self.name
                    ));
                }
                (a, b)
            } else {
                let a = self.value(range)?;
                // `a/n` runs from a to the field's end.
                (a, if step.is_some() { self.max } else { a })
            };
            let step = step.unwrap_or(1);
            let mut v = lo;
            while v <= hi {
                mask |= 1 << v;
                v += step;
            }
        }
        Ok(mask)
    }
}

impl Cron {
    /// Parses `text`, or says which field breaks which rule.
    pub fn parse(text: &str) -> Result<Self, String> {
        let expanded = match text.trim() {
            "@yearly" | "@annually" => "0 0 1 1 *",
            "@monthly" => "0 0 1 * *",
            "@weekly" => "0 0 * * 0",
            "@daily" | "@midnight" => "0 0 * * *",
            "@hourly" => "0 * * * *",
            other if other.starts_with('@') => {
                return Err(format!(
                    "{other:?} is not a macro; expected @yearly, @monthly, @weekly, @daily or @hourly"
                ));
            }
            other => other,
        };
        let parts: Vec<&str> = expanded.split_whitespace().collect();
        if parts.len() != 5 {
            return Err(format!(
                "{text:?} has {} fields; a cron expression has five: minute hour day-of-month \
                 month day-of-week (e.g. \"0 8 * * mon-fri\")",
                parts.len()
            ));
        }
        let mut masks = [0u64; 5];
        for ((mask, field), part) in masks.iter_mut().zip(&FIELDS).zip(&parts) {
            *mask = field.parse(part)?;
        }
        let mut weekdays = masks[4];
        if weekdays & (1 << 7) != 0 {
            weekdays = (weekdays | 1) & !(1 << 7);
        }
        let cron = Self {
            text: text.trim().to_owned(),
            minutes: masks[0],
            hours: masks[1],
            days: masks[2],
            months: masks[3],
            weekdays,
            any_day: parts[2] == "*",
            any_weekday: parts[4] == "*",
        };
        if !cron.can_fire() {
            return Err(format!(
                "{text:?} never fires: no month in it has such a day of month"
            ));
        }
        Ok(cron)
    }

    /// The expression as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Whether some day of some year matches (a restricted weekday always matches some day).
    fn can_fire(&self) -> bool {
        // Longest month lengths, February in a leap year.
        const LONGEST: [u32; 12] = [31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31];
        if !self.any_weekday {
            return true;
        }
        (1..=12u32).any(|m| {
            self.months & (1 << m) != 0
                && (1..=LONGEST[(m - 1) as usize]).any(|d| self.days & (1 << d) != 0)
        })
    }

    fn matches_day(&self, date: Date) -> bool {
        let month = u32::try_from(date.month()).unwrap_or(0);
        if self.months & (1 << month) == 0 {
            return false;
        }
        let day = self.days & (1 << u32::try_from(date.day()).unwrap_or(0)) != 0;
        let weekday = self.weekdays
            & (1 << u32::try_from(date.weekday().to_sunday_zero_offset()).unwrap_or(0))
            != 0;
        match (self.any_day, self.any_weekday) {
            (true, true) => true,
            (false, true) => day,
            (true, false) => weekday,
            (false, false) => day || weekday,
        }
    }

    /// The times of a matching day, in order: (hour, minute).
    fn times(&self) -> impl DoubleEndedIterator<Item = (i8, i8)> + '_ {
        (0..24i8)
            .filter(|h| self.hours & (1 << h) != 0)
            .flat_map(move |h| {
                (0..60i8)
                    .filter(|m| self.minutes & (1 << m) != 0)
                    .map(move |m| (h, m))
            })
    }

    fn instant(zone: &TimeZone, date: Date, (h, m): (i8, i8)) -> Option<Timestamp> {
        let at: DateTime = date.at(h, m, 0, 0);
        zone.to_ambiguous_timestamp(at).compatible().ok()
    }

    /// The first occurrence strictly after `after`, in `zone`; `None` when there is none
    /// within [`SEARCH_DAYS`] (or past the end of time jiff knows).
    pub fn next_after(&self, after: Timestamp, zone: &TimeZone) -> Option<Timestamp> {
        // From [`DST_MARGIN`] before the civil time, so that a time a DST change moves is not
        // missed; earlier civil times are never after `after`.
        let floor = zone.to_datetime(after).checked_sub(DST_MARGIN).ok()?;
        let mut date = floor.date();
        for _ in 0..=SEARCH_DAYS {
            if self.matches_day(date) {
                for t in self.times() {
                    if date.at(t.0, t.1, 0, 0) < floor {
                        continue;
                    }
                    if let Some(at) = Self::instant(zone, date, t).filter(|at| *at > after) {
                        return Some(at);
                    }
                }
            }
            date = date.tomorrow().ok()?;
        }
        None
    }

    /// The latest occurrence at or before `at`, in `zone`; `None` when there is none within
    /// [`SEARCH_DAYS`].
    pub fn latest_at_or_before(&self, at: Timestamp, zone: &TimeZone) -> Option<Timestamp> {
        let ceiling = zone.to_datetime(at).checked_add(DST_MARGIN).ok()?;
        let mut date = ceiling.date();
        for _ in 0..=SEARCH_DAYS {
            if self.matches_day(date) {
                for t in self.times().rev() {
                    if date.at(t.0, t.1, 0, 0) > ceiling {
                        continue;
                    }
                    if let Some(when) = Self::instant(zone, date, t).filter(|w| *w <= at) {
                        return Some(when);
                    }
                }
            }
            date = date.yesterday().ok()?;
        }
        None
    }
}

impl std::fmt::Display for Cron {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(text: &str) -> Timestamp {
        text.parse().unwrap()
    }

    fn berlin() -> TimeZone {
        TimeZone::get("Europe/Berlin").unwrap()
    }

    #[test]
    fn fields_read_values_ranges_steps_lists_and_names() {
        let c = Cron::parse("*/15 8-18/2 1,15 jan-mar mon-fri").unwrap();
        assert_eq!(c.minutes, (1 << 0) | (1 << 15) | (1 << 30) | (1 << 45));
        assert_eq!(
            c.hours,
            (1 << 8) | (1 << 10) | (1 << 12) | (1 << 14) | (1 << 16) | (1 << 18)
        );
        assert_eq!(c.days, (1 << 1) | (1 << 15));
        assert_eq!(c.months, 0b1110);
        assert_eq!(c.weekdays, 0b11_1110);
        assert_eq!(
            Cron::parse("0 0 * * 7").unwrap().weekdays,
            1,
            "7 is Sunday as 0 is"
        );
        assert_eq!(
            Cron::parse("@daily").unwrap(),
            Cron {
                text: "@daily".into(),
                ..Cron::parse("0 0 * * *").unwrap()
            }
        );
    }

    #[test]
    fn bad_expressions_say_which_field_and_rule() {
        for (text, says) in [
            ("0 8 * *", "five"),
            ("60 8 * * *", "minute field: 60 is out of range 0-59"),
            ("0 25 * * *", "hour field"),
            ("0 8 0 * *", "day of month field"),
            ("0 8 * foo *", "month field"),
            ("0 8 * * 1-x", "day of week field"),
            ("0 8 * * 5-1", "runs backwards"),
            ("*/0 8 * * *", "step"),
            ("0 0 30 2 *", "never fires"),
            ("@sometimes", "not a macro"),
        ] {
            let e = Cron::parse(text).unwrap_err();
            assert!(e.contains(says), "{text}: {e}");
        }
    }

    #[test]
    fn the_next_occurrence_is_strictly_after_and_in_the_zone() {
        let c = Cron::parse("0 8 * * mon-fri").unwrap();
        // Friday 2026-11-27 09:00 in Berlin (UTC+1): next is Monday 08:00 Berlin = 07:00 UTC.
        let next = c.next_after(at("2026-11-27T08:00:00Z"), &berlin()).unwrap();
        assert_eq!(next, at("2026-11-30T07:00:00Z"));
        // Exactly at an occurrence: the next one, not itself.
        assert_eq!(
            c.next_after(next, &berlin()).unwrap(),
            at("2026-12-01T07:00:00Z")
        );
        assert_eq!(c.latest_at_or_before(next, &berlin()).unwrap(), next);
        assert_eq!(
            c.latest_at_or_before(at("2026-11-29T12:00:00Z"), &berlin())
                .unwrap(),
            at("2026-11-27T07:00:00Z")
        );
    }

    #[test]
    fn daylight_saving_gaps_fire_after_the_gap_and_folds_fire_once() {
        let c = Cron::parse("30 2 * * *").unwrap();
        // 2026-03-29 02:30 does not exist in Berlin: it fires at 03:30 CEST = 01:30 UTC.
        let next = c.next_after(at("2026-03-28T12:00:00Z"), &berlin()).unwrap();
        assert_eq!(next, at("2026-03-29T01:30:00Z"));
        // 2026-10-25 02:30 happens twice: the first (CEST, 00:30 UTC) only.
        let fold = c.next_after(at("2026-10-24T12:00:00Z"), &berlin()).unwrap();
        assert_eq!(fold, at("2026-10-25T00:30:00Z"));
        assert_eq!(
            c.next_after(fold, &berlin()).unwrap(),
            at("2026-10-26T01:30:00Z")
        );
    }

    #[test]
    fn rare_days_are_found_and_either_day_field_matches_when_both_are_set() {
        let leap = Cron::parse("0 0 29 2 *").unwrap();
        assert_eq!(
            leap.next_after(at("2097-01-01T00:00:00Z"), &TimeZone::UTC)
                .unwrap(),
            at("2104-02-29T00:00:00Z")
        );
        // The 12th (a Thursday in November 2026) or any Friday.
        let c = Cron::parse("0 0 12 * fri").unwrap();
        assert_eq!(
            c.next_after(at("2026-11-01T00:00:00Z"), &TimeZone::UTC)
                .unwrap(),
            at("2026-11-06T00:00:00Z")
        );
        assert_eq!(
            c.next_after(at("2026-11-07T00:00:00Z"), &TimeZone::UTC)
                .unwrap(),
            at("2026-11-12T00:00:00Z")
        );
    }
}
