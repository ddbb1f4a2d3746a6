//! KV-cache byte accounting from a model's configuration.

use std::path::Path;

use pw_hf::ModelConfig;

/// KV bytes one layer stores per cached token, and how many tokens it keeps at most.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerKv {
    /// `kv_heads × head_dim × 2 (K and V) × bytes per element`.
    pub bytes_per_token: u64,
    /// Sliding-window layers keep at most this many tokens.
    pub window: Option<usize>,
}

/// Per-layer KV sizes of a model: the engine's admission control and metrics use it to turn
/// token counts into bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvLayout {
    /// One entry per decoder layer.
    pub layers: Vec<LayerKv>,
}

impl KvLayout {
    /// The layout of `config` with KV elements of `elem_bytes` bytes (4 for f32, 2 for f16).
    ///
    /// K and V are both counted on every layer (Gemma's K=V layers included), as the Burn cache
    /// stores both.
    pub fn from_config(config: &ModelConfig, elem_bytes: u64) -> Self {
        let layer = |kv_heads: usize, head_dim: usize, window: Option<usize>| LayerKv {
            bytes_per_token: kv_heads as u64 * head_dim as u64 * 2 * elem_bytes,
            window,
        };
        let layers = match config {
            ModelConfig::Mixtral(c) => (0..c.num_hidden_layers)
                .map(|_| layer(c.num_key_value_heads, c.head_dim, c.sliding_window))
                .collect(),
            ModelConfig::Qwen2Moe(c) => (0..c.num_hidden_layers)
                .map(|i| layer(c.num_key_value_heads, c.head_dim, c.layer_windows.get(i).copied().flatten()))
                .collect(),
            ModelConfig::Gemma4(c) => c
                .layers
                .iter()
                .map(|l| layer(l.num_key_value_heads, l.head_dim, l.sliding.then_some(c.sliding_window)))
                .collect(),
        };
        Self { layers }
    }

    /// Bytes a sequence of `tokens` tokens holds in the cache (saturating at `u64::MAX`, so an
    /// absurd request compares as too large instead of wrapping).
    pub fn bytes_for(&self, tokens: usize) -> u64 {
        self.layers.iter().fold(0u64, |sum, l| {
            sum.saturating_add(
                l.bytes_per_token.saturating_mul(l.window.map_or(tokens, |w| tokens.min(w)) as u64),
            )
        })
    }

    /// Bytes per token on a model without sliding windows (upper bound otherwise).
    pub fn bytes_per_token(&self) -> u64 {
        self.layers.iter().map(|l| l.bytes_per_token).sum()
    }
}

/// The context length of a model directory: `max_position_embeddings` of config.json (or of
/// its `text_config`), if present.
pub fn max_context(dir: &Path) -> Option<usize> {
    let text = std::fs::read_to_string(dir.join("config.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    let get = |v: &serde_json::Value| v.get("max_position_embeddings").and_then(serde_json::Value::as_u64);
    get(&v).or_else(|| v.get("text_config").and_then(get)).map(|n| n as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_layers_heads_and_windows() {
        let kv = KvLayout {
            layers: vec![
                LayerKv { bytes_per_token: 2 * 8 * 2 * 2, window: None },
                LayerKv { bytes_per_token: 100, window: Some(4) },
            ],
        };
        assert_eq!(kv.bytes_for(0), 0);
        assert_eq!(kv.bytes_for(3), 3 * 64 + 300);
        // The sliding layer stops growing at its window.
        assert_eq!(kv.bytes_for(10), 10 * 64 + 400);
    }

    #[test]
    fn mixtral_fixture_layout() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/pw-models/tests/fixtures/mixtral");
        let cfg = ModelConfig::from_dir(&dir).unwrap();
        let kv = KvLayout::from_config(&cfg, 4);
        // 3 layers × 2 KV heads × head_dim 8 (32 / 4 heads) × K,V × f32.
        assert_eq!(kv.bytes_per_token(), 3 * 2 * 8 * 2 * 4);
        assert_eq!(max_context(&dir), Some(256));
    }
}
