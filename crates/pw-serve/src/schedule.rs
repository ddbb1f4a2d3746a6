//! One step's plan under a token budget, in the manner of chunked prefill (Sarathi, vLLM):
//! every running sequence that is decoding gets its one token, sequences still in their
//! prompt get chunks of what is left (oldest first), and waiting requests join while the
//! batch, the KV memory and the step's token budget allow.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// A running sequence, as the plan sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Running {
    /// Tokens not yet in its cache (≥ 1): 1 when decoding, the rest of the prompt (or of a
    /// resumed sequence's tokens) while prefilling.
    pub pending: usize,
}

/// A sequence that may start this step (a preempted one or a queued request).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Candidate {
    /// Tokens it has to prefill.
    pub tokens: usize,
    /// KV bytes admission reserves for it.
    pub kv_bytes: u64,
}

/// What one step may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StepLimits {
    /// Tokens through the model in one step (at least the batch, so decodes always fit).
    pub tokens: usize,
    /// Sequences running at once.
    pub batch: usize,
    /// KV bytes admission can still reserve.
    pub kv_room: u64,
}

/// The plan: tokens fed to each running sequence, then how many candidates start (in order)
/// and the tokens fed to each of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StepPlan {
    /// Per running sequence (same order), tokens fed this step (0 = waits).
    pub feed: Vec<usize>,
    /// Per admitted candidate (the first `admit.len()`), tokens fed this step (≥ 1).
    pub admit: Vec<usize>,
}

/// Plans one step. `running` is oldest first; `candidates` in admission order. Decoding
/// sequences (pending 1) always run; prompt chunks fill the budget oldest first, and the
/// oldest running sequence always progresses, so nothing starves. An idle engine admits its
/// first candidate whatever the limits (`submit` refused what cannot fit alone).
pub(crate) fn plan_step(running: &[Running], candidates: &[Candidate], limits: StepLimits) -> StepPlan {
    let mut left = limits.tokens;
    let mut feed = vec![0; running.len()];
    for (f, r) in feed.iter_mut().zip(running) {
        if r.pending == 1 {
            *f = 1;
            left = left.saturating_sub(1);
        }
    }
    for (i, r) in running.iter().enumerate() {
        if r.pending > 1 {
            let n = if i == 0 { r.pending.min(left.max(1)) } else { r.pending.min(left) };
            feed[i] = n;
            left = left.saturating_sub(n);
        }
    }
    let mut admit = Vec::new();
    let mut kv_room = limits.kv_room;
    for c in candidates {
        let idle = running.is_empty() && admit.is_empty();
        let fits = running.len() + admit.len() < limits.batch && c.kv_bytes <= kv_room && left > 0;
        if !(idle || fits) {
            break;
        }
        let n = c.tokens.min(left.max(1)).max(1);
        admit.push(n);
        kv_room = kv_room.saturating_sub(c.kv_bytes);
        left = left.saturating_sub(n);
    }
    StepPlan { feed, admit }
}

/// KV memory the planner keeps free for the requests a steady stream will bring next: the
/// largest request submitted within the last `window`. While requests keep arriving, memory
/// freed by a finished sequence stays with the cache for the next prompt instead of going back
/// to the weights and being taken again a moment later; once none has arrived for `window`,
/// the reserve is gone and the weights get the memory back.
#[derive(Debug, Clone)]
pub(crate) struct ArrivalReserve {
    window: Duration,
    /// Submission time and KV bytes of the recent requests, oldest first.
    recent: VecDeque<(Instant, u64)>,
}

impl ArrivalReserve {
    pub(crate) fn new(window: Duration) -> Self {
        Self { window, recent: VecDeque::new() }
    }

    /// A request of `bytes` KV bytes submitted at `at`.
    pub(crate) fn note(&mut self, at: Instant, bytes: u64) {
        while self.recent.front().is_some_and(|&(t, _)| t + self.window <= at) {
            self.recent.pop_front();
        }
        self.recent.push_back((at, bytes));
    }

    /// The bytes held back at `now`.
    pub(crate) fn bytes(&self, now: Instant) -> u64 {
        self.recent.iter().filter(|&&(t, _)| t + self.window > now).map(|&(_, b)| b).max().unwrap_or(0)
    }

    /// How long after `now` the reserve ends (`None`: it has).
    pub(crate) fn ends_in(&self, now: Instant) -> Option<Duration> {
        let end = self.recent.back()?.0 + self.window;
        (end > now).then(|| end - now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(tokens: usize, batch: usize, kv_room: u64) -> StepLimits {
        StepLimits { tokens, batch, kv_room }
    }

    fn running(pending: &[usize]) -> Vec<Running> {
        pending.iter().map(|&pending| Running { pending }).collect()
    }

    fn cand(tokens: usize, kv_bytes: u64) -> Candidate {
        Candidate { tokens, kv_bytes }
    }

    #[test]
    fn decodes_run_first_and_prompt_chunks_fill_the_budget() {
        let plan = plan_step(&running(&[1, 100, 1, 50]), &[], limits(64, 8, 0));
        assert_eq!(plan.feed, vec![1, 62, 1, 0]);
        assert!(plan.admit.is_empty());
    }

    #[test]
    fn a_long_prompt_is_split_across_steps_at_the_budget() {
        let mut pending = 1000;
        let mut steps = 0;
        while pending > 0 {
            let plan = plan_step(&running(&[pending]), &[], limits(256, 4, 0));
            assert!(plan.feed[0] <= 256);
            pending -= plan.feed[0];
            steps += 1;
        }
        assert_eq!(steps, 4);
    }

    #[test]
    fn candidates_join_while_batch_kv_and_tokens_allow() {
        let c = [cand(10, 100), cand(10, 100), cand(10, 100)];
        // The batch holds two more.
        assert_eq!(plan_step(&running(&[1]), &c, limits(64, 3, 1000)).admit, vec![10, 10]);
        // KV room for one.
        assert_eq!(plan_step(&running(&[1]), &c, limits(64, 8, 150)).admit, vec![10]);
        // Tokens for one and a chunk of the next.
        assert_eq!(plan_step(&running(&[1]), &c, limits(16, 8, 1000)).admit, vec![10, 5]);
        // Admission is in order: a candidate that does not fit holds back those behind it.
        let c = [cand(10, 500), cand(10, 1)];
        assert!(plan_step(&running(&[1]), &c, limits(64, 8, 100)).admit.is_empty());
    }

    #[test]
    fn an_idle_engine_admits_its_first_candidate_whatever_the_limits() {
        let plan = plan_step(&[], &[cand(5000, u64::MAX), cand(1, 1)], limits(64, 1, 0));
        assert_eq!(plan.admit, vec![64]);
    }

    #[test]
    fn the_oldest_prompt_progresses_even_when_decodes_take_the_budget() {
        let plan = plan_step(&running(&[30, 1, 1, 1, 1]), &[cand(1, 0)], limits(4, 8, 100));
        assert_eq!(plan.feed, vec![1, 1, 1, 1, 1]);
        assert!(plan.admit.is_empty());
    }

    #[test]
    fn prompt_chunks_go_to_the_oldest_sequences_first() {
        let plan = plan_step(&running(&[1, 40, 40, 40]), &[cand(40, 0)], limits(64, 8, 100));
        assert_eq!(plan.feed, vec![1, 40, 23, 0]);
        assert!(plan.admit.is_empty());
    }

    /// Random workloads drain: every sequence finishes, the oldest always progresses and no
    /// step exceeds its budget (beyond the one token an idle or starved oldest sequence takes).
    #[test]
    fn random_workloads_drain_without_starvation() {
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        let mut rand = |n: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % n
        };
        for _ in 0..50 {
            let budget = 8 + rand(100) as usize;
            let batch = 1 + rand(8) as usize;
            let mut queue: Vec<(usize, usize)> =
                (0..20).map(|_| (1 + rand(300) as usize, 1 + rand(20) as usize)).collect();
            queue.reverse();
            // (pending, decodes left)
            let mut live: Vec<(usize, usize)> = Vec::new();
            let mut steps = 0;
            while !(live.is_empty() && queue.is_empty()) {
                steps += 1;
                assert!(steps < 100_000, "no progress");
                let r: Vec<Running> = live.iter().map(|&(pending, _)| Running { pending }).collect();
                let c: Vec<Candidate> = queue.iter().rev().map(|&(t, _)| cand(t, 1)).collect();
                let plan = plan_step(&r, &c, limits(budget, batch, 1_000));
                let fed: usize = plan.feed.iter().chain(&plan.admit).sum();
                assert!(fed <= budget + 1, "{fed} tokens over a budget of {budget}");
                assert!(live.len() + plan.admit.len() <= batch.max(1));
                if let Some(&f) = plan.feed.first() {
                    assert!(f >= 1, "the oldest sequence waited");
                }
                for _ in &plan.admit {
                    live.push(queue.pop().unwrap());
                }
                let feeds: Vec<usize> = plan.feed.iter().chain(&plan.admit).copied().collect();
                for (s, f) in live.iter_mut().zip(feeds) {
                    s.0 -= f;
                    if s.0 == 0 {
                        // The step sampled a token: decode on, or end.
                        s.1 -= 1;
                        s.0 = usize::from(s.1 > 0);
                    }
                }
                live.retain(|s| s.0 > 0);
            }
        }
    }
    #[test]
    fn the_arrival_reserve_holds_the_largest_recent_request_until_the_stream_stops() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut r = ArrivalReserve::new(ms(2000));
        assert_eq!((r.bytes(t0), r.ends_in(t0)), (0, None));
        r.note(t0, 300);
        r.note(t0 + ms(500), 100);
        // The largest of the window, whatever came after it.
        assert_eq!(r.bytes(t0 + ms(600)), 300);
        // The large one has left the window; the small one holds until 2 s after it came.
        assert_eq!(r.bytes(t0 + ms(2100)), 100);
        assert_eq!(r.ends_in(t0 + ms(2100)), Some(ms(400)));
        // A steady stream keeps it up.
        r.note(t0 + ms(2400), 200);
        assert_eq!(r.bytes(t0 + ms(2450)), 200);
        // Silence for a whole window: nothing held, and nothing left to wait for.
        assert_eq!(r.bytes(t0 + ms(4400)), 0);
        assert_eq!(r.ends_in(t0 + ms(4400)), None);
        // Old entries are dropped as new ones arrive.
        r.note(t0 + ms(9000), 50);
        assert_eq!(r.recent.len(), 1);
    }
}
