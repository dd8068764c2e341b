//! tandem-engine
