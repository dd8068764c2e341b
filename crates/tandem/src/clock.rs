//! Wall-clock times as people read them, in UTC, without a calendar crate.

use std::time::{SystemTime, UNIX_EPOCH};

/// A moment in UTC, to the second.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UtcTime {
    pub year: i64,
    pub month: u32,
    pub day: u32,
    pub hour: u32,
    pub minute: u32,
    pub second: u32,
}

impl UtcTime {
    /// The time now.
    pub fn now() -> Self {
        Self::from_system_time(SystemTime::now())
    }

    /// The UTC date and time of `time` (times before 1970 read as 1970-01-01).
    pub fn from_system_time(time: SystemTime) -> Self {
        let seconds = time
            .duration_since(UNIX_EPOCH)
            .map_or(0, |elapsed| elapsed.as_secs());
        let (year, month, day) = civil_from_days((seconds / 86_400) as i64);
        let of_day = seconds % 86_400;
        UtcTime {
            year,
            month,
            day,
            hour: (of_day / 3600) as u32,
            minute: (of_day / 60 % 60) as u32,
            second: (of_day % 60) as u32,
        }
    }

    /// `2026-12-01 01:32:07 UTC`.
    pub fn readable(&self) -> String {
        format!(
            "{:04}-{:02}-{:02} {:02}:{:02}:{:02} UTC",
            self.year, self.month, self.day, self.hour, self.minute, self.second
        )
    }

    /// `20261201-013207`, for file names.
    pub fn compact(&self) -> String {
        format!(
            "{:04}{:02}{:02}-{:02}{:02}{:02}",
            self.year, self.month, self.day, self.hour, self.minute, self.second
        )
    }
}

/// The proleptic Gregorian (year, month, day) of a count of days since 1970-01-01
/// (Howard Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * month_index + 2) / 5 + 1) as u32;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
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
    }
}
