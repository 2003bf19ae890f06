//! handoff-kv
