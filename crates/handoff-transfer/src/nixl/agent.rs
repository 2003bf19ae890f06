//! The process's NIXL agent: one per process, made on first use, with the
//! UCX backend. Made only when the real library is loaded (the `stub-api`
//! build of `nixl-sys` resolves NIXL at run time and would otherwise abort
//! the process at its first call) and the backend can be created; either
//! failure is an error naming the loader path searched and `UCX_TLS`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use handoff_kv::ShmRegion;
use nixl_sys::{Agent, AgentConfig, Backend, Params, ThreadSync};

use super::region::{Registration, Span};
use crate::error::TransportError;

/// NIXL's UCX progress thread waits on the workers' event descriptors and
/// wakes at least this often (NIXL rounds to milliseconds; its default, 0,
/// makes the thread busy-poll a whole core while idle). Transfers wake it
/// through their events; this is only the fallback tick.
const PROGRESS_FALLBACK_US: u64 = 100_000;

/// The process's agent and what it has registered and loaded.
pub struct Nixl {
    agent: Agent,
    _backend: Backend,
    name: String,
    /// Regions registered, by (address, length): links to the same pool
    /// share one registration.
    regions: Mutex<HashMap<(usize, usize), Weak<Registration>>>,
    /// Remote agents loaded, with how many links use each.
    remotes: Mutex<HashMap<String, usize>>,
}

impl std::fmt::Debug for Nixl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nixl").field("name", &self.name).finish()
    }
}

static NIXL: OnceLock<Result<Arc<Nixl>, String>> = OnceLock::new();

/// The process's agent, made on first use. A failure is kept: every later
/// call reports the same error.
pub fn nixl() -> Result<Arc<Nixl>, TransportError> {
    NIXL.get_or_init(|| Nixl::start().map(Arc::new))
        .clone()
        .map_err(TransportError::Nixl)
}

/// Where the loader looked, for an error message.
fn searched() -> String {
    let env = |k: &str| std::env::var(k).unwrap_or_else(|_| "(unset)".into());
    format!(
        "LD_LIBRARY_PATH={}, UCX_TLS={}, NIXL_PLUGIN_DIR={}",
        env("LD_LIBRARY_PATH"),
        env("UCX_TLS"),
        env("NIXL_PLUGIN_DIR")
    )
}

impl Nixl {
    fn start() -> Result<Nixl, String> {
        if nixl_sys::is_stub() {
            return Err(format!(
                "libnixl_capi.so was not found by the dynamic loader, so only \
                 nixl-sys's stub is loaded and nothing would move ({}); run \
                 scripts/fetch-nixl.sh and put the folder it prints on LD_LIBRARY_PATH",
                searched()
            ));
        }
        let name = format!(
            "handoff-{}-{:016x}",
            std::process::id(),
            rand::random::<u64>()
        );
        let cfg = AgentConfig {
            enable_prog_thread: true,
            pthr_delay_us: PROGRESS_FALLBACK_US,
            thread_sync: ThreadSync::Strict,
            ..AgentConfig::default()
        };
        let agent = Agent::new_configured(&name, &cfg)
            .map_err(|e| format!("creating the NIXL agent: {e} ({})", searched()))?;
        let backend = Self::ucx(&agent).map_err(|e| {
            format!(
                "creating NIXL's UCX backend: {e} ({}); UCX_TLS must include tcp \
                 (UCX needs it for peer failure handling)",
                searched()
            )
        })?;
        tracing::info!(agent = %name, "nixl agent up (UCX backend)");
        Ok(Nixl {
            agent,
            _backend: backend,
            name,
            regions: Mutex::new(HashMap::new()),
            remotes: Mutex::new(HashMap::new()),
        })
    }

    fn ucx(agent: &Agent) -> Result<Backend, nixl_sys::NixlError> {
        let (_, defaults) = agent.get_plugin_params("UCX")?;
        let kv: Vec<(String, String)> = defaults
            .iter()?
            .filter_map(|p| p.ok())
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let params = Params::from(kv.iter().map(|(k, v)| (k.as_str(), v.as_str())))?;
        agent.create_backend("UCX", &params)
    }

    /// This agent's name (unique per process and start).
    pub fn name(&self) -> &str {
        &self.name
    }

    pub(super) fn agent(&self) -> &Agent {
        &self.agent
    }

    /// Register `region` (or share its existing registration).
    pub fn register(&self, region: &Arc<ShmRegion>) -> Result<Arc<Registration>, TransportError> {
        let key = (region.addr(), region.len());
        let mut regions = self.regions.lock().expect("nixl regions");
        if let Some(r) = regions.get(&key).and_then(Weak::upgrade) {
            return Ok(r);
        }
        let span = Span {
            addr: key.0,
            len: key.1,
        };
        let handle = self
            .agent
            .register_memory(&span, None)
            .map_err(|e| TransportError::Nixl(format!("registering {} bytes: {e}", key.1)))?;
        let r = Arc::new(Registration {
            _handle: handle,
            region: region.clone(),
        });
        regions.retain(|_, w| w.strong_count() > 0);
        regions.insert(key, Arc::downgrade(&r));
        Ok(r)
    }

    /// Whether `addr..addr + len` is a region this agent has registered.
    pub(super) fn has_registered(&self, addr: usize, len: usize) -> bool {
        let regions = self.regions.lock().expect("nixl regions");
        regions
            .get(&(addr, len))
            .is_some_and(|w| w.strong_count() > 0)
    }

    /// This agent's metadata (its registrations and how to reach it), for
    /// a peer to load.
    pub fn local_metadata(&self) -> Result<Vec<u8>, TransportError> {
        self.agent
            .get_local_md()
            .map_err(|e| TransportError::Nixl(format!("getting local metadata: {e}")))
    }

    /// Load the metadata of the peer agent `name`; it stays loaded while
    /// the returned handle (or another for the same agent) lives. Our own
    /// agent (a peer in this process) needs no loading: NIXL reads its own
    /// registrations locally.
    pub fn load_remote(
        self: &Arc<Self>,
        name: &str,
        md: &[u8],
    ) -> Result<RemoteAgent, TransportError> {
        if name == self.name {
            return Ok(RemoteAgent {
                nixl: self.clone(),
                name: name.to_string(),
                local: true,
            });
        }
        // Another link to the same peer loaded it already.
        if let Some(n) = self.remotes.lock().expect("nixl remotes").get_mut(name) {
            *n += 1;
            return Ok(RemoteAgent {
                nixl: self.clone(),
                name: name.to_string(),
                local: false,
            });
        }
        let loaded = self
            .agent
            .load_remote_md(md)
            .map_err(|e| TransportError::Nixl(format!("loading the prefill's metadata: {e}")))?;
        if loaded != name {
            return Err(TransportError::PeerMisbehaved(format!(
                "nixl link setup: agent {name:?} sent the metadata of {loaded:?}"
            )));
        }
        let name = loaded;
        *self
            .remotes
            .lock()
            .expect("nixl remotes")
            .entry(name.clone())
            .or_default() += 1;
        Ok(RemoteAgent {
            nixl: self.clone(),
            name,
            local: false,
        })
    }
}

/// A loaded peer agent; its metadata is invalidated when the last handle
/// for it goes (a transfer still in flight keeps its own connection).
#[derive(Debug)]
pub struct RemoteAgent {
    nixl: Arc<Nixl>,
    name: String,
    /// Our own agent (nothing was loaded).
    local: bool,
}

impl RemoteAgent {
    /// The peer agent's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Our agent.
    pub fn nixl(&self) -> &Arc<Nixl> {
        &self.nixl
    }
}

impl Drop for RemoteAgent {
    fn drop(&mut self) {
        if self.local {
            return;
        }
        let mut remotes = self.nixl.remotes.lock().expect("nixl remotes");
        let last = match remotes.get_mut(&self.name) {
            Some(n) if *n > 1 => {
                *n -= 1;
                false
            }
            _ => true,
        };
        if last {
            remotes.remove(&self.name);
            let _ = self.nixl.agent.invalidate_remote_md(&self.name);
        }
    }
}
