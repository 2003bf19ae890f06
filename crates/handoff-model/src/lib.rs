//! handoff-model
