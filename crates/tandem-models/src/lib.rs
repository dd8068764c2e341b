//! tandem-models
