//! handoff-engine
