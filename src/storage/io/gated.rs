//! A test backend whose completions the test releases one at a time, so the order reads enter
//! the backend in is observable (the I/O stage's tests).
#![allow(clippy::unwrap_used)]

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::{AlignSource, Completion, DioAlign, IoError, IoStats, ReadBackend, ReadOp};

/// Submissions in order, and completions allowed so far.
#[derive(Default)]
pub struct Gate {
    /// (tag, file offset, length) of every read submitted.
    log: Mutex<Vec<(u64, u64, usize)>>,
    permits: Mutex<usize>,
    changed: Condvar,
}

impl Gate {
    /// Lets `n` more reads complete.
    pub fn release(&self, n: usize) {
        *self.permits.lock().unwrap() += n;
        self.changed.notify_all();
    }

    /// The file offsets submitted so far, once at least `n` are (or after 10 s).
    pub fn offsets_after(&self, n: usize) -> Vec<u64> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let log = self.log.lock().unwrap();
            if log.len() >= n || Instant::now() > deadline {
                return log.iter().map(|e| e.1).collect();
            }
            drop(log);
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

/// Completes reads in submission order, each only once the gate allows it. Writes nothing.
pub struct GatedBackend {
    gate: Arc<Gate>,
    in_flight: VecDeque<u64>,
    align: u32,
}

impl GatedBackend {
    pub fn new(gate: Arc<Gate>, align: u32) -> GatedBackend {
        GatedBackend { gate, in_flight: VecDeque::new(), align }
    }
}

impl ReadBackend for GatedBackend {
    /// # Safety
    ///
    /// Nothing is written to `op.dst`.
    unsafe fn submit(&mut self, op: ReadOp) -> Result<(), IoError> {
        self.gate.log.lock().unwrap().push((op.tag, op.offset, op.len));
        self.in_flight.push_back(op.tag);
        Ok(())
    }

    fn reap(&mut self, out: &mut Vec<Completion>, wait_for: usize) -> Result<(), IoError> {
        let mut permits = self.gate.permits.lock().unwrap();
        let mut reaped = 0;
        while reaped < wait_for || (*permits > 0 && !self.in_flight.is_empty()) {
            if *permits == 0 {
                permits = self.gate.changed.wait(permits).unwrap();
                continue;
            }
            let Some(tag) = self.in_flight.pop_front() else { break };
            *permits -= 1;
            out.push(Completion { tag, result: Ok(()) });
            reaped += 1;
        }
        Ok(())
    }

    fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    fn stats(&self) -> IoStats {
        IoStats::default()
    }

    fn dio_align(&self) -> DioAlign {
        DioAlign { mem_align: self.align, offset_align: self.align, source: AlignSource::Default }
    }
}
