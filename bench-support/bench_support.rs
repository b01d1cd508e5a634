//! Measuring and printing helpers of the backends' benchmarks
//! (`bench_redis`, `bench_postgres`, `bench_etcd`). Each example includes
//! this file as a module of its own:
//!
//! ```text
//! #[path = "../../bench-support/bench_support.rs"]
//! mod bench_support;
//! ```
//!
//! so that no library crate carries benchmark code in its API.

// Each benchmark uses the helpers it needs, not all of them.
#![allow(dead_code)]

use std::future::Future;
use std::time::Duration;

/// The middle value of `v` (of an even count, the upper of the two).
pub(crate) fn median<T: Copy + PartialOrd>(mut v: Vec<T>) -> T {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    v[v.len() / 2]
}

/// The value at quantile `p` (0 to 1) of `sorted`, by nearest rank.
pub(crate) fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

/// Runs `rounds` rounds, each measuring every kind `0..kinds` once with
/// `measure`, in an order that rotates from round to round (round `r`
/// starts with kind `r % kinds`): the machine's speed drifts over seconds,
/// and kinds measured within one short round see the same drift. Gives
/// each kind's samples in round order.
pub(crate) async fn rotating_rounds<S, E, F, Fut>(
    kinds: usize,
    rounds: usize,
    mut measure: F,
) -> Result<Vec<Vec<S>>, E>
where
    F: FnMut(usize) -> Fut,
    Fut: Future<Output = Result<S, E>>,
{
    let mut samples: Vec<Vec<S>> = (0..kinds).map(|_| Vec::with_capacity(rounds)).collect();
    for round in 0..rounds {
        for step in 0..kinds {
            let i = (round + step) % kinds;
            samples[i].push(measure(i).await?);
        }
    }
    Ok(samples)
}

/// A sample that rounds compare as a ratio: a time per cycle or a rate.
pub(crate) trait Sample: Copy {
    /// The sample as a number.
    fn value(self) -> f64;
}

impl Sample for Duration {
    fn value(self) -> f64 {
        self.as_secs_f64()
    }
}

impl Sample for f64 {
    fn value(self) -> f64 {
        self
    }
}

/// Each round's own ratio of `samples` over `base`.
pub(crate) fn round_ratios<T: Sample>(samples: &[T], base: &[T]) -> Vec<f64> {
    samples
        .iter()
        .zip(base)
        .map(|(a, b)| a.value() / b.value())
        .collect()
}

/// The median, lowest and highest of the rounds' ratios.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Spread {
    pub(crate) median: f64,
    pub(crate) low: f64,
    pub(crate) high: f64,
}

impl Spread {
    /// The spread of `ratios` (not empty).
    pub(crate) fn of(ratios: &[f64]) -> Self {
        let (low, high) = ratios
            .iter()
            .fold((f64::MAX, f64::MIN), |(l, h), r| (l.min(*r), h.max(*r)));
        Self {
            median: median(ratios.to_vec()),
            low,
            high,
        }
    }

    /// Prints `  LABEL: 1.234x (rounds 1.000x to 1.500x)`.
    pub(crate) fn print(&self, label: &str) {
        println!(
            "  {label}: {:.3}x (rounds {:.3}x to {:.3}x)",
            self.median, self.low, self.high
        );
    }
}

/// User + system CPU time of this process, from /proc (Linux).
pub(crate) fn cpu_time() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let after_name = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = after_name.split(' ').collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    // Clock ticks are 100 Hz on every Linux this runs on.
    Some(Duration::from_millis((utime + stime) * 10))
}
