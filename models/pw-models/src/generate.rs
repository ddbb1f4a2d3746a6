//! Token sampling and the KV-cached generation loop.

use burn::tensor::{Int, Tensor, TensorData, backend::Backend};

use crate::common::{CausalLm, ModelCache};

/// How to pick each next token and when to stop.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingConfig {
    /// Softmax temperature; `0` means greedy (argmax).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens (`0` = all).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `top_p` (`1.0` = all).
    pub top_p: f32,
    /// Seed of the sampler's random stream.
    pub seed: u64,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Generation stops after emitting one of these.
    pub stop_tokens: Vec<u32>,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        Self { temperature: 0.0, top_k: 0, top_p: 1.0, seed: 0, max_tokens: 128, stop_tokens: Vec::new() }
    }
}

/// Picks tokens from logits with temperature, top-k and top-p, reproducibly from a seed.
#[derive(Debug, Clone)]
pub struct Sampler {
    cfg: SamplingConfig,
    state: u64,
}

impl Sampler {
    /// A sampler seeded from `cfg.seed`.
    pub fn new(cfg: SamplingConfig) -> Self {
        let state = cfg.seed ^ 0x853c_49e6_748f_ea9b;
        Self { cfg, state }
    }

    /// The configuration.
    pub fn config(&self) -> &SamplingConfig {
        &self.cfg
    }

    /// Uniform in [0, 1) (SplitMix64).
    fn uniform(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Chooses the next token from one row of logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.cfg.temperature <= 0.0 {
            return argmax(logits);
        }
        // Filters in the transformers order: temperature, top-k, top-p.
        let t = self.cfg.temperature as f64;
        let max = logits[argmax(logits) as usize] as f64;
        // Only logits within `NEGLIGIBLE` of the best are sorted: a smaller one's weight is below
        // half an ulp of the running total (which starts at the best token's 1), so leaving it
        // out changes no sum and no draw, and a large vocabulary is not sorted every token.
        const NEGLIGIBLE: f64 = 60.0;
        let floor = max - NEGLIGIBLE * t;
        let mut order: Vec<usize> = (0..logits.len()).filter(|&i| logits[i] as f64 >= floor).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        let mut keep = order.len();
        if self.cfg.top_k > 0 && self.cfg.top_k < keep {
            // Ties with the k-th logit survive, as in transformers.
            let threshold = logits[order[self.cfg.top_k - 1]];
            keep = order.iter().take_while(|&&i| logits[i] >= threshold).count();
        }
        let weights: Vec<f64> = order[..keep].iter().map(|&i| ((logits[i] as f64 - max) / t).exp()).collect();
        let total: f64 = weights.iter().sum();
        if self.cfg.top_p < 1.0 {
            let mut cum = 0.0;
            let mut n = 0;
            for w in &weights {
                cum += w / total;
                n += 1;
                if cum >= self.cfg.top_p as f64 {
                    break;
                }
            }
            keep = n.max(1);
        }
        let total: f64 = weights[..keep].iter().sum();
        let mut r = self.uniform() * total;
        for (j, w) in weights[..keep].iter().enumerate() {
            if r < *w {
                return order[j] as u32;
            }
            r -= w;
        }
        order[keep - 1] as u32
    }
}

/// Index of the largest logit (the first on ties, like `torch.argmax`).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Ids as a `[1, seq]` tensor.
pub fn ids_tensor<B: Backend>(ids: &[u32], device: &B::Device) -> Tensor<B, 2, Int> {
    let data: Vec<i64> = ids.iter().map(|&i| i as i64).collect();
    Tensor::from_data(TensorData::new(data, [1, ids.len()]), device)
}

/// Last position's logits of a `[1, seq, vocab]` output, on the host.
pub fn last_logits<B: Backend>(logits: Tensor<B, 3>) -> Vec<f32> {
    let [_, t, v] = logits.dims();
    logits.narrow(1, t - 1, 1).reshape([v]).into_data().convert::<f32>().to_vec::<f32>().expect("f32 logits")
}

/// Generates up to `max_tokens` tokens after `prompt`, calling `on_token` with each as it is
/// chosen; stops early on a stop token (which is included) or when `on_token` returns false.
pub fn generate<B: Backend, M: CausalLm<B>>(
    model: &M,
    prompt: &[u32],
    sampler: &mut Sampler,
    device: &B::Device,
    mut on_token: impl FnMut(u32) -> bool,
) -> Vec<u32> {
    let mut cache: ModelCache<B> = model.new_cache();
    let mut out = Vec::new();
    if prompt.is_empty() || sampler.config().max_tokens == 0 {
        return out;
    }
    let mut logits = last_logits(model.forward(ids_tensor::<B>(prompt, device), &mut cache, None));
    loop {
        let tok = sampler.sample(&logits);
        out.push(tok);
        let go_on = on_token(tok);
        if !go_on || sampler.config().stop_tokens.contains(&tok) || out.len() >= sampler.config().max_tokens {
            return out;
        }
        logits = last_logits(model.forward(ids_tensor::<B>(&[tok], device), &mut cache, None));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(temperature: f32, top_k: usize, top_p: f32, seed: u64) -> SamplingConfig {
        SamplingConfig { temperature, top_k, top_p, seed, ..Default::default() }
    }

    #[test]
    fn greedy_is_argmax_first_on_ties() {
        let mut s = Sampler::new(cfg(0.0, 0, 1.0, 1));
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0]), 1);
    }

    #[test]
    fn top_k_one_is_greedy_at_any_temperature() {
        let mut s = Sampler::new(cfg(5.0, 1, 1.0, 7));
        for _ in 0..50 {
            assert_eq!(s.sample(&[0.0, 1.0, 0.5, 0.9]), 1);
        }
    }

    #[test]
    fn top_p_keeps_the_nucleus_only() {
        // Probabilities ~ [0.64, 0.24, 0.09, 0.03]: top_p 0.8 keeps the first two.
        let logits = [2.0f32, 1.0, 0.0, -1.0];
        let mut s = Sampler::new(cfg(1.0, 0, 0.8, 3));
        let mut seen = [0usize; 4];
        for _ in 0..2000 {
            seen[s.sample(&logits) as usize] += 1;
        }
        assert_eq!(seen[2] + seen[3], 0, "{seen:?}");
        // Renormalised over the nucleus: 0.64 / 0.88 ≈ 0.73.
        let frac = seen[0] as f64 / 2000.0;
        assert!((frac - 0.731).abs() < 0.04, "{frac}");
    }

    #[test]
    fn same_seed_same_tokens() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let run = |seed| {
            let mut s = Sampler::new(cfg(1.0, 0, 1.0, seed));
            (0..20).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
    }
}
