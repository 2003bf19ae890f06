//! handoff-server
