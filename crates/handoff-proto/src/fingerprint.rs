//! What two ends must agree on to move KV: the model, the KV geometry and
//! layout, the TP position ([`Fingerprint::check_compatible`]).

use crate::error::HandshakeError;
use crate::ids::Role;
use crate::layout::KvDtype;
use crate::rank;

/// How a KV pool is laid out in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KvLayoutKind {
    /// Layer-major, then page, then K before V; each block is
    /// `[kv_head][token_slot][head_dim]` (see [`crate::layout::PageLayout`]).
    LayerPageKv,
}

impl KvLayoutKind {
    /// Stable name.
    pub const fn name(self) -> &'static str {
        match self {
            KvLayoutKind::LayerPageKv => "layer-page-kv",
        }
    }

    /// Wire code.
    pub const fn code(self) -> u8 {
        match self {
            KvLayoutKind::LayerPageKv => 0,
        }
    }

    /// From a wire code.
    pub fn from_code(code: u8) -> Option<Self> {
        match code {
            0 => Some(KvLayoutKind::LayerPageKv),
            _ => None,
        }
    }
}

/// What must match between a prefill and a decode before any byte of KV moves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint {
    /// Model identity (name / path), for humans.
    pub model_id: String,
    /// Hash of the weights (e.g. SHA-256 of the GGUF tensor data), so two
    /// files with the same name but different weights do not pair.
    pub model_hash: [u8; 32],
    /// Transformer layers.
    pub layers: u32,
    /// KV heads of the whole model (before TP sharding).
    pub kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Tokens per page.
    pub page_size: u32,
    /// Element type.
    pub dtype: KvDtype,
    /// Memory layout.
    pub layout: KvLayoutKind,
    /// This worker's TP rank.
    pub tp_rank: u32,
    /// This worker group's TP size.
    pub tp_size: u32,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Fingerprint {
    /// Compare with the peer's fingerprint. `self` is `our_role`'s. The error
    /// names the first differing field and both values, prefill first.
    pub fn check_compatible(
        &self,
        our_role: Role,
        peer: &Fingerprint,
    ) -> Result<(), HandshakeError> {
        let (p, d) = match our_role {
            Role::Prefill => (self, peer),
            Role::Decode => (peer, self),
        };
        let fields: [(&'static str, String, String); 8] = [
            ("model", p.model_id.clone(), d.model_id.clone()),
            ("model hash", hex(&p.model_hash), hex(&d.model_hash)),
            ("layers", p.layers.to_string(), d.layers.to_string()),
            ("KV heads", p.kv_heads.to_string(), d.kv_heads.to_string()),
            ("head dim", p.head_dim.to_string(), d.head_dim.to_string()),
            (
                "page size",
                p.page_size.to_string(),
                d.page_size.to_string(),
            ),
            ("KV dtype", p.dtype.name().into(), d.dtype.name().into()),
            ("KV layout", p.layout.name().into(), d.layout.name().into()),
        ];
        for (field, prefill, decode) in fields {
            if prefill != decode {
                return Err(HandshakeError::Incompatible {
                    field,
                    prefill,
                    decode,
                });
            }
        }
        if rank::head_assignment(p.kv_heads, p.tp_size).is_err()
            || rank::head_assignment(d.kv_heads, d.tp_size).is_err()
        {
            return Err(HandshakeError::Incompatible {
                field: "TP size (must divide or be a multiple of the KV heads)",
                prefill: format!("{} for {} KV heads", p.tp_size, p.kv_heads),
                decode: format!("{} for {} KV heads", d.tp_size, d.kv_heads),
            });
        }
        Ok(())
    }
}
