//! Wall-clock times as people read them, in UTC, to the second (humantime's RFC 3339).

use std::time::{SystemTime, UNIX_EPOCH};

/// A moment in UTC, to the second, as RFC 3339 writes it (`2026-12-01T01:32:07Z`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UtcTime {
    rfc3339: String,
}

impl UtcTime {
    /// The time now.
    pub fn now() -> Self {
        Self::from_system_time(SystemTime::now())
    }

    /// The UTC date and time of `time` (times before 1970 read as 1970-01-01).
    pub fn from_system_time(time: SystemTime) -> Self {
        let time = time.max(UNIX_EPOCH);
        UtcTime {
            rfc3339: humantime::format_rfc3339_seconds(time).to_string(),
        }
    }

    /// `2026-12-01 01:32:07 UTC`.
    pub fn readable(&self) -> String {
        let time = self.rfc3339.trim_end_matches('Z').replacen('T', " ", 1);
        format!("{time} UTC")
    }

    /// `20261201-013207`, for file names.
    pub fn compact(&self) -> String {
        let digits: String = self.rfc3339.chars().filter(char::is_ascii_digit).collect();
        let (date, time) = digits.split_at(8.min(digits.len()));
        format!("{date}-{time}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn known_moments_read_as_their_dates() {
        let at =
            |seconds: u64| UtcTime::from_system_time(UNIX_EPOCH + Duration::from_secs(seconds));
        assert_eq!(at(0).readable(), "1970-01-01 00:00:00 UTC");
        assert_eq!(at(951_782_400).readable(), "2000-02-29 00:00:00 UTC");
        assert_eq!(at(1_700_000_000).readable(), "2023-11-14 22:13:20 UTC");
        assert_eq!(at(1_700_000_000).compact(), "20231114-221320");
        assert_eq!(at(4_102_444_799).readable(), "2099-12-31 23:59:59 UTC");
        let before_1970 = UNIX_EPOCH - Duration::from_secs(86_400);
        assert_eq!(
            UtcTime::from_system_time(before_1970).readable(),
            "1970-01-01 00:00:00 UTC"
        );
    }
}
