//! Where scratch buffers come from: allocated for real, or only counted. Every scratch is built
//! by one function generic over [`Buffers`], so the bytes the memory plan reserves for a scratch
//! (counted, before anything large is allocated) are the bytes its constructor allocates, by
//! construction: there is no second formula to keep in step.

/// A source of zeroed buffers.
pub trait Buffers {
    /// `n` zeroed f32s.
    fn zeros(&mut self, n: usize) -> Vec<f32>;
    /// `n` zeroed bytes.
    fn zero_bytes(&mut self, n: usize) -> Vec<u8>;
    /// An empty vector with room for `n` elements.
    fn with_capacity<T>(&mut self, n: usize) -> Vec<T>;
    /// `n` elements made by `make` (which may take buffers of its own).
    fn each<T>(&mut self, n: usize, make: impl FnMut(&mut Self) -> T) -> Vec<T>
    where
        Self: Sized;
}

/// Allocates.
pub struct Allocate;

impl Buffers for Allocate {
    fn zeros(&mut self, n: usize) -> Vec<f32> {
        vec![0.0; n]
    }

    fn zero_bytes(&mut self, n: usize) -> Vec<u8> {
        vec![0; n]
    }

    fn with_capacity<T>(&mut self, n: usize) -> Vec<T> {
        Vec::with_capacity(n)
    }

    fn each<T>(&mut self, n: usize, mut make: impl FnMut(&mut Self) -> T) -> Vec<T> {
        (0..n).map(|_| make(self)).collect()
    }
}

/// Counts the bytes [`Allocate`] would allocate and allocates nothing (every vector it hands
/// out is empty).
#[derive(Default)]
pub struct Count {
    pub bytes: u64,
}

impl Count {
    fn add<T>(&mut self, n: usize) {
        self.bytes += (n * std::mem::size_of::<T>()) as u64;
    }
}

impl Buffers for Count {
    fn zeros(&mut self, n: usize) -> Vec<f32> {
        self.add::<f32>(n);
        Vec::new()
    }

    fn zero_bytes(&mut self, n: usize) -> Vec<u8> {
        self.add::<u8>(n);
        Vec::new()
    }

    fn with_capacity<T>(&mut self, n: usize) -> Vec<T> {
        self.add::<T>(n);
        Vec::new()
    }

    fn each<T>(&mut self, n: usize, mut make: impl FnMut(&mut Self) -> T) -> Vec<T> {
        self.add::<T>(n);
        for _ in 0..n {
            drop(make(self));
        }
        Vec::new()
    }
}

/// The bytes `build` allocates, without allocating them.
pub fn counted<T>(build: impl FnOnce(&mut Count) -> T) -> u64 {
    let mut c = Count::default();
    drop(build(&mut c));
    c.bytes
}
