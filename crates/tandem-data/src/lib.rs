//! tandem-data
