//! Kubernetes resource quantities (`10Gi`, `500m`, `1e3`), exactly, with no floating point.
//!
//! Values are held as a count of nano-units in an `i128`, which covers every quantity a GPU
//! driver meets (up to about 1.7e29) with Kubernetes' own finest precision. Anything finer than
//! a nano-unit or out of range is an error rather than a silent rounding.

use std::cmp::Ordering;
use std::fmt;

use crate::error::{Error, Result};

const NANOS_PER_UNIT: i128 = 1_000_000_000;

/// Which suffix family a quantity was written in; kept so it prints back in the same style.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Format {
    /// Powers of 1024: `Ki`, `Mi`, `Gi`, ...
    BinarySi,
    /// Powers of 1000: `m`, `k`, `M`, ... (also the default for plain numbers).
    #[default]
    DecimalSi,
    /// Scientific notation: `1e3`.
    DecimalExponent,
}

/// An exact Kubernetes quantity.
#[derive(Debug, Clone, Copy, Default)]
pub struct Quantity {
    nanos: i128,
    format: Format,
}

impl PartialEq for Quantity {
    fn eq(&self, other: &Self) -> bool {
        self.nanos == other.nanos
    }
}
impl Eq for Quantity {}
impl std::hash::Hash for Quantity {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.nanos.hash(state);
    }
}
impl PartialOrd for Quantity {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Quantity {
    fn cmp(&self, other: &Self) -> Ordering {
        self.nanos.cmp(&other.nanos)
    }
}

fn quantity_error(value: &str, reason: impl Into<String>) -> Error {
    Error::Quantity {
        value: value.to_owned(),
        reason: reason.into(),
    }
}

impl Quantity {
    /// Zero.
    pub const ZERO: Self = Self {
        nanos: 0,
        format: Format::DecimalSi,
    };

    /// A whole number of units (bytes, percent, ...), printed in decimal style.
    pub fn from_units(units: i64) -> Self {
        Self {
            nanos: i128::from(units) * NANOS_PER_UNIT,
            format: Format::DecimalSi,
        }
    }

    /// A whole number of bytes, printed in binary style (`80Gi`) where it divides evenly.
    pub fn from_bytes(bytes: u64) -> Self {
        Self {
            nanos: i128::from(bytes) * NANOS_PER_UNIT,
            format: Format::BinarySi,
        }
    }

    /// Parses a quantity as Kubernetes writes it.
    pub fn parse(text: &str) -> Result<Self> {
        let s = text.trim();
        if s.is_empty() {
            return Err(quantity_error(text, "empty quantity"));
        }
        if s.len() > 128 {
            return Err(quantity_error(text, "longer than 128 characters"));
        }
        let (negative, rest) = match s.as_bytes()[0] {
            b'-' => (true, &s[1..]),
            b'+' => (false, &s[1..]),
            _ => (false, s),
        };
        let number_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (number, suffix) = rest.split_at(number_end);
        let (int_part, frac_part) = match number.split_once('.') {
            Some((i, f)) => (i, f),
            None => (number, ""),
        };
        if int_part.is_empty() && frac_part.is_empty() {
            return Err(quantity_error(text, "expected a number"));
        }
        if frac_part.contains('.') {
            return Err(quantity_error(text, "more than one decimal point"));
        }
        let (format, multiplier, exp10) = parse_suffix(suffix).ok_or_else(|| {
            quantity_error(text, format!("unknown suffix {suffix:?}; expected one of n u m k M G T P E Ki Mi Gi Ti Pi Ei or an exponent like e3"))
        })?;
        // mantissa digits as an integer, with the decimal point moved right by frac_part.len()
        let digits = format!("{int_part}{frac_part}");
        let digits = digits.trim_start_matches('0');
        if digits.len() > 38 {
            return Err(quantity_error(text, "too many digits"));
        }
        let mut mantissa: i128 = if digits.is_empty() {
            0
        } else {
            digits
                .parse()
                .map_err(|_| quantity_error(text, "not a number"))?
        };
        let frac_len =
            i32::try_from(frac_part.len()).map_err(|_| quantity_error(text, "too many digits"))?;
        // value = mantissa * multiplier * 10^(exp10 - frac_len) units; in nanos add 9.
        let overflow = || quantity_error(text, "out of range");
        mantissa = mantissa.checked_mul(multiplier).ok_or_else(overflow)?;
        let shift = exp10 - frac_len + 9;
        let nanos = if shift >= 0 {
            let factor = 10_i128
                .checked_pow(shift.unsigned_abs())
                .ok_or_else(overflow)?;
            mantissa.checked_mul(factor).ok_or_else(overflow)?
        } else {
            let factor = 10_i128.checked_pow(shift.unsigned_abs());
            match factor {
                Some(f) if mantissa % f == 0 => mantissa / f,
                _ if mantissa == 0 => 0,
                _ => {
                    return Err(quantity_error(
                        text,
                        "finer than the smallest unit Kubernetes keeps (1n)",
                    ));
                }
            }
        };
        Ok(Self {
            nanos: if negative { -nanos } else { nanos },
            format,
        })
    }

    /// Parses a k8s-openapi quantity.
    pub fn from_k8s(q: &k8s_openapi::apimachinery::pkg::api::resource::Quantity) -> Result<Self> {
        Self::parse(&q.0)
    }

    /// The quantity as a k8s-openapi value, in canonical form.
    pub fn to_k8s(self) -> k8s_openapi::apimachinery::pkg::api::resource::Quantity {
        k8s_openapi::apimachinery::pkg::api::resource::Quantity(self.to_string())
    }

    /// The value in nano-units.
    pub fn nanos(self) -> i128 {
        self.nanos
    }

    /// Builds a quantity from nano-units, in the given print style.
    pub fn from_nanos(nanos: i128, format: Format) -> Self {
        Self { nanos, format }
    }

    /// The value as whole units, if it is a whole number that fits an `i64`.
    pub fn as_units(self) -> Option<i64> {
        if self.nanos % NANOS_PER_UNIT != 0 {
            return None;
        }
        i64::try_from(self.nanos / NANOS_PER_UNIT).ok()
    }

    /// The value rounded up to whole units (Kubernetes' `Value()`), saturating at the `i64` range.
    pub fn ceil_units(self) -> i64 {
        let units = self.nanos.div_euclid(NANOS_PER_UNIT)
            + i128::from(self.nanos.rem_euclid(NANOS_PER_UNIT) != 0);
        i64::try_from(units).unwrap_or(if units < 0 { i64::MIN } else { i64::MAX })
    }

    /// The print style.
    pub fn format(self) -> Format {
        self.format
    }

    /// Whether the value is below zero.
    pub fn is_negative(self) -> bool {
        self.nanos < 0
    }

    /// Whether the value is zero.
    pub fn is_zero(self) -> bool {
        self.nanos == 0
    }

    /// Sum, or `None` on overflow.
    pub fn checked_add(self, other: Self) -> Option<Self> {
        Some(Self {
            nanos: self.nanos.checked_add(other.nanos)?,
            format: self.format,
        })
    }

    /// Difference, or `None` on overflow.
    pub fn checked_sub(self, other: Self) -> Option<Self> {
        Some(Self {
            nanos: self.nanos.checked_sub(other.nanos)?,
            format: self.format,
        })
    }

    /// Sum, saturating at the representable range.
    #[must_use]
    pub fn saturating_add(self, other: Self) -> Self {
        Self {
            nanos: self.nanos.saturating_add(other.nanos),
            format: self.format,
        }
    }

    /// Difference, saturating at the representable range.
    #[must_use]
    pub fn saturating_sub(self, other: Self) -> Self {
        Self {
            nanos: self.nanos.saturating_sub(other.nanos),
            format: self.format,
        }
    }
}

/// (format, integer multiplier, power of ten) for a suffix.
fn parse_suffix(suffix: &str) -> Option<(Format, i128, i32)> {
    let binary = |p: u32| Some((Format::BinarySi, 1024_i128.pow(p), 0));
    let decimal = |e: i32| Some((Format::DecimalSi, 1, e));
    match suffix {
        "" => decimal(0),
        "n" => decimal(-9),
        "u" => decimal(-6),
        "m" => decimal(-3),
        "k" => decimal(3),
        "M" => decimal(6),
        "G" => decimal(9),
        "T" => decimal(12),
        "P" => decimal(15),
        "E" => decimal(18),
        "Ki" => binary(1),
        "Mi" => binary(2),
        "Gi" => binary(3),
        "Ti" => binary(4),
        "Pi" => binary(5),
        "Ei" => binary(6),
        _ => {
            let exp = suffix.strip_prefix(['e', 'E'])?;
            let digits = exp.strip_prefix(['+', '-']).unwrap_or(exp);
            if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) || digits.len() > 4
            {
                return None;
            }
            Some((Format::DecimalExponent, 1, exp.parse().ok()?))
        }
    }
}

impl fmt::Display for Quantity {
    /// Canonical form, as the API server would write it back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sign = if self.nanos < 0 { "-" } else { "" };
        let abs = self.nanos.unsigned_abs();
        if abs == 0 {
            return f.write_str("0");
        }
        let nanos_per_unit = NANOS_PER_UNIT.unsigned_abs();
        if self.format == Format::BinarySi && abs.is_multiple_of(nanos_per_unit) {
            let units = abs / nanos_per_unit;
            if units >= 1024 {
                let suffixes = ["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"];
                let mut value = units;
                let mut chosen = "";
                for s in suffixes {
                    if value.is_multiple_of(1024) {
                        value /= 1024;
                        chosen = s;
                    } else {
                        break;
                    }
                }
                if !chosen.is_empty() {
                    return write!(f, "{sign}{value}{chosen}");
                }
            }
        }
        // Decimal: the largest suffix (power of 1000) that keeps the mantissa whole.
        let suffixes = [
            ("n", 0),
            ("u", 3),
            ("m", 6),
            ("", 9),
            ("k", 12),
            ("M", 15),
            ("G", 18),
            ("T", 21),
            ("P", 24),
            ("E", 27),
        ];
        let mut best = ("n", abs);
        for (suffix, exp) in suffixes {
            let div = 10_u128.pow(exp);
            if abs.is_multiple_of(div) {
                best = (suffix, abs / div);
            } else {
                break;
            }
        }
        write!(f, "{sign}{}{}", best.1, best.0)
    }
}

impl std::str::FromStr for Quantity {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Self::parse(s)
    }
}

impl serde::Serialize for Quantity {
    fn serialize<S: serde::Serializer>(
        &self,
        serializer: S,
    ) -> std::result::Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Quantity {
    fn deserialize<D: serde::Deserializer<'de>>(
        deserializer: D,
    ) -> std::result::Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Quantity;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a Kubernetes quantity such as 10Gi, 50 or 500m")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> std::result::Result<Quantity, E> {
                Quantity::parse(v).map_err(E::custom)
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> std::result::Result<Quantity, E> {
                Ok(Quantity::from_units(v))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> std::result::Result<Quantity, E> {
                i64::try_from(v)
                    .map(Quantity::from_units)
                    .map_err(|_| E::custom("quantity out of range"))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> std::result::Result<Quantity, E> {
                Quantity::parse(&v.to_string()).map_err(E::custom)
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(s: &str) -> Quantity {
        Quantity::parse(s).unwrap()
    }

    #[test]
    fn parses_every_suffix_family() {
        assert_eq!(q("10Gi").as_units(), Some(10 * 1024 * 1024 * 1024));
        assert_eq!(q("1k").as_units(), Some(1000));
        assert_eq!(q("1e3").as_units(), Some(1000));
        assert_eq!(q("1.5").nanos(), 1_500_000_000);
        assert_eq!(q("500m").nanos(), 500_000_000);
        assert_eq!(q("-5Gi").as_units(), Some(-5 * 1024 * 1024 * 1024));
        assert_eq!(q(".5Ki").as_units(), Some(512));
        assert_eq!(q("50").as_units(), Some(50));
    }

    #[test]
    fn rejects_malformed_and_too_fine_values() {
        for bad in [
            "", "Gi", "1.2.3", "10GB", "1x", "1e", "0.1n", "1e99999", "--1",
        ] {
            assert!(Quantity::parse(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn prints_canonical_form() {
        assert_eq!(q("1024Mi").to_string(), "1Gi");
        assert_eq!(q("0.5Gi").to_string(), "512Mi");
        assert_eq!(q("1000").to_string(), "1k");
        assert_eq!(q("1.5").to_string(), "1500m");
        assert_eq!(q("50").to_string(), "50");
        assert_eq!(q("0").to_string(), "0");
        assert_eq!(Quantity::from_bytes(80 * (1 << 30)).to_string(), "80Gi");
        assert_eq!(q("100Mi").to_string(), "100Mi");
        assert_eq!(q("1500Ki").to_string(), "1500Ki");
    }

    #[test]
    fn compares_across_formats() {
        assert_eq!(q("1Gi"), q("1073741824"));
        assert!(q("1G") < q("1Gi"));
        assert_eq!(q("1.5").ceil_units(), 2);
    }
}
