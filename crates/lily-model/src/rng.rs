//! Counter-based random numbers: the value at any index is a pure function of (seed, stream, index), so the
//! synthetic weights and the sampler draw the same numbers on the CPU and in a GPU kernel, in any order.
//! (A crate RNG would give a sequential stream that a GPU kernel cannot reproduce.)

/// splitmix64's finaliser: a bijective 64-bit mix.
#[inline]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[inline]
pub fn hash3(seed: u64, stream: u64, index: u64) -> u64 {
    mix64(seed ^ mix64(stream.wrapping_add(0x9e37_79b9_7f4a_7c15) ^ mix64(index)))
}

/// Uniform in [0, 1) with 24 bits of resolution (exact in f32).
#[inline]
pub fn uniform_at(seed: u64, stream: u64, index: u64) -> f32 {
    (hash3(seed, stream, index) >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
}

/// A sequential generator over one (seed, stream).
#[derive(Clone, Debug)]
pub struct Rng {
    seed: u64,
    counter: u64,
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng { seed, counter: 0 }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.counter += 1;
        hash3(self.seed, 0, self.counter)
    }

    /// Counts one draw without computing it and returns its index: a device that draws `hash3(seed, 0, index)`
    /// itself then stays in step with this generator.
    pub fn advance(&mut self) -> u64 {
        self.counter += 1;
        self.counter
    }

    /// Takes back the last draw (of `advance`, `next_u64` or `uniform`): the next one repeats it.
    pub fn retreat(&mut self) {
        self.counter = self.counter.saturating_sub(1);
    }

    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f32 {
        let u1 = self.uniform().max(1e-7);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_is_in_range_and_roughly_uniform() {
        let n = 100_000;
        let mean: f64 = (0..n).map(|i| uniform_at(7, 3, i) as f64).sum::<f64>() / n as f64;
        assert!((mean - 0.5).abs() < 0.01, "{mean}");
        assert!((0..n).all(|i| (0.0..1.0).contains(&uniform_at(7, 3, i))));
        assert_ne!(uniform_at(7, 3, 0), uniform_at(8, 3, 0));
        assert_ne!(uniform_at(7, 3, 0), uniform_at(7, 4, 0));
    }
}
