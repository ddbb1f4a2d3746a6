//! The fast path's warm-up compiles every kernel variant serving reaches: once a model is
//! loaded, prompts of many lengths, decode batches of every size up to the cap and long
//! contexts compile nothing more (a compilation inside a step stalls every request in it).
//! Its own test binary: CubeCL's compilation log is configured once per process, before the
//! first client.

use std::path::Path;
use std::time::Duration;

use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
use cubecl::wgpu::WgpuRuntime;
use pw_models::{Sampler, SamplingConfig};
use pw_serve::{DecodeSlot, FastOptions, FastStepModel, MemoryOptions, PrefillSlot, StepModel, WeightPolicy};
use pw_testkit::{asset, wgpu_client};

/// The kernels compiled so far, by name (one log line each), once the log stops growing.
fn compiled(log: &Path) -> Vec<String> {
    let read = || std::fs::read_to_string(log).unwrap_or_default();
    let mut last = read();
    loop {
        std::thread::sleep(Duration::from_millis(300));
        let now = read();
        if now == last {
            return now.lines().filter(|l| l.starts_with("[Compiling kernel]")).map(str::to_owned).collect();
        }
        last = now;
    }
}

#[test]
fn after_warm_up_serving_compiles_no_kernel() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("compile.log");
    let config = serde_json::json!({
        "compilation": { "logger": { "level": "basic", "file": log, "append": false } }
    });
    CubeClRuntimeConfig::set(serde_json::from_value(config).unwrap());

    let client = wgpu_client();
    let model_dir = asset("tiny-qwen2-moe");
    // The planner under a budget with room to spare: it samples the routing (the routing
    // kernels with their statistics) every other step.
    let max_batch = 8;
    let memory = MemoryOptions {
        budget_bytes: Some(64 << 20),
        policy: WeightPolicy::Planner,
        routing_every: 2,
        ..Default::default()
    };
    let options = FastOptions {
        bits: 6,
        kv_budget_bytes: 0,
        max_batch,
        max_context: 256,
        memory,
        residual_head: false,
        max_step_tokens: pw_decode::DEFAULT_MAX_STEP_TOKENS,
    };
    let mut model = FastStepModel::<WgpuRuntime, f32>::load_with(&client, &model_dir, &options).unwrap();
    let warm = compiled(&log);
    assert!(!warm.is_empty(), "the warm-up compiled nothing: is the compilation log on?");

    // Prompts of 1..=200 tokens, alone and several ending in one step, each followed by decode
    // steps of every live sequence, so the decode batches grow to the cap over contexts of up
    // to ~200 positions; a boundary between steps, as the engine runs them.
    let sampler = Sampler::new(SamplingConfig { temperature: 0.0, ..Default::default() });
    let mut live: Vec<(u64, u32)> = Vec::new();
    let groups: [&[usize]; 8] = [&[1], &[3, 5], &[9], &[17, 1, 2], &[31, 33], &[64], &[100, 150], &[200]];
    let mut seq = 0u64;
    for lens in groups {
        let prompts: Vec<Vec<u32>> =
            lens.iter().map(|&n| (0..n as u32).map(|t| 3 + t % 50).collect()).collect();
        let mut samplers: Vec<Sampler> = prompts.iter().map(|_| sampler.clone()).collect();
        let mut slots: Vec<PrefillSlot<'_>> = prompts
            .iter()
            .zip(&mut samplers)
            .enumerate()
            .map(|(i, (tokens, sampler))| PrefillSlot {
                seq: seq + i as u64,
                start: 0,
                tokens,
                sample: true,
                sampler,
            })
            .collect();
        let firsts = model.prefill(&mut slots).unwrap();
        for (i, first) in firsts.into_iter().enumerate() {
            live.push((seq + i as u64, first.unwrap().unwrap()));
        }
        seq += lens.len() as u64;
        model.boundary(pw_serve::KvDemand::default()).unwrap();
        while live.len() > max_batch {
            model.release(live.remove(0).0);
        }
        for _ in 0..3 {
            let mut samplers: Vec<Sampler> = live.iter().map(|_| sampler.clone()).collect();
            let mut slots: Vec<DecodeSlot<'_>> = live
                .iter()
                .zip(&mut samplers)
                .map(|(&(seq, last), sampler)| DecodeSlot { seq, last, sampler })
                .collect();
            let next = model.decode(&mut slots).unwrap();
            for (l, t) in live.iter_mut().zip(next) {
                l.1 = t.unwrap();
            }
            model.boundary(pw_serve::KvDemand::default()).unwrap();
        }
    }
    for (seq, _) in live {
        model.release(seq);
    }
    let after = compiled(&log);
    let new: Vec<&String> = after.iter().skip(warm.len()).collect();
    assert!(new.is_empty(), "{} kernels compiled while serving after the warm-up: {new:?}", new.len());
}
