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
use pw_serve::{DecodeSlot, FastStepModel, PrefillSlot, StepModel};
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
    let max_batch = 8;
    let mut model = FastStepModel::<WgpuRuntime, f32>::load(
        &client,
        &asset("tiny-qwen2-moe"),
        6,
        1 << 22,
        max_batch,
        256,
    )
    .unwrap();
    let warm = compiled(&log);
    assert!(!warm.is_empty(), "the warm-up compiled nothing: is the compilation log on?");

    // Prompts of 1..=200 tokens, each followed by decode steps of every live sequence, so the
    // decode batches grow to the cap over contexts of up to ~200 positions.
    let mut sampler = Sampler::new(SamplingConfig { temperature: 0.0, ..Default::default() });
    let mut live: Vec<(u64, u32)> = Vec::new();
    for (i, n) in [1usize, 3, 5, 9, 17, 31, 33, 64, 100, 150, 200].into_iter().enumerate() {
        let seq = i as u64;
        let prompt: Vec<u32> = (0..n as u32).map(|t| 3 + t % 50).collect();
        let slot = PrefillSlot { seq, start: 0, tokens: &prompt, sample: true, sampler: &mut sampler };
        let first = model.prefill(&mut [slot]).unwrap().remove(0).unwrap().unwrap();
        live.push((seq, first));
        if live.len() > max_batch {
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
        }
    }
    for (seq, _) in live {
        model.release(seq);
    }
    let after = compiled(&log);
    let new: Vec<&String> = after.iter().skip(warm.len()).collect();
    assert!(new.is_empty(), "{} kernels compiled while serving after the warm-up: {new:?}", new.len());
}
