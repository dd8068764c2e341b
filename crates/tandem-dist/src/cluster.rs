//! Cluster environments.
