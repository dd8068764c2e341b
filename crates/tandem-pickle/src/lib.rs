//! tandem-pickle
