//! handoff-proto
