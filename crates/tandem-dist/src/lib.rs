//! tandem-dist
