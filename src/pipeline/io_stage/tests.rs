//! The I/O stage over a backend whose completions the test releases one at a time, so the
//! order reads enter the backend in is observable.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::storage::io::gated::{Gate, GatedBackend};
use crate::storage::io::BufOptions;
use crate::storage::stream::arena::{Arena, FileRange, Region};
use crate::storage::stream::reads::OpMeta;

const PIECE: usize = 4096;

/// A stage whose window is 8 pieces (so guesses may hold 2), and an arena to read into.
fn stage() -> (IoStage, Arc<Gate>, Arena) {
    let gate = Arc::new(Gate::default());
    let g = Arc::clone(&gate);
    let factory: BackendFactory =
        Box::new(move || Ok(Box::new(GatedBackend::new(g, PIECE as u32)) as Box<dyn ReadBackend>));
    let buf = Arc::new(AlignedBuf::new(1 << 20, &BufOptions::default()).unwrap());
    let tracer = Arc::new(Tracer::new(false));
    let io = IoStage::spawn(factory, 8 * PIECE, PIECE, None, tracer, vec![Arc::clone(&buf)]).unwrap();
    (io, gate, Arena::new(buf, false))
}

/// Sends one read of `pieces` pieces at file offset `offset` into its own arena region.
fn send(io: &IoStage, arena: &Arena, priority: Priority, offset: u64, pieces: usize) -> Ticket {
    let len = pieces * PIECE;
    let mut slot = arena.slot(Region { off: offset as usize, len });
    let ticket = io.reserve();
    let target = slot.start_read(ticket);
    let meta = OpMeta { name: "test read", kind: priority.kind(), layer: None, expert: None };
    let op = arena.op(target, 0, FileRange { file: 0, offset, len, min_len: len }, meta);
    io.submit(priority, vec![(ticket, vec![op])]);
    ticket
}

fn wait_done(io: &IoStage, ticket: Ticket) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !io.is_done(ticket) {
        assert!(Instant::now() < deadline, "ticket {ticket} never completed");
        std::thread::sleep(Duration::from_millis(1));
    }
    io.wait(ticket).unwrap();
}

#[test]
fn a_demand_read_jumps_ahead_of_every_guess_piece_not_yet_in_the_device() {
    let (io, gate, arena) = stage();
    let guess = send(&io, &arena, Priority::Guess, 0, 16);
    assert_eq!(gate.offsets_after(8).len(), 8, "guesses fill the window, no more");
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(gate.offsets_after(8).len(), 8);
    let demand = send(&io, &arena, Priority::Demand, 512 << 10, 2);
    // One guess piece completes; the demand read enters before any other guess piece.
    gate.release(1);
    let log = gate.offsets_after(9);
    let first: Vec<u64> = (0..8).map(|i| (i * PIECE) as u64).collect();
    assert_eq!(log[..8], first[..], "{log:?}");
    assert_eq!(log[8], 512 << 10, "{log:?}");
    gate.release(1000);
    wait_done(&io, demand);
    wait_done(&io, guess);
    // 16 guess pieces and the demand read, which enters whole.
    let log = gate.offsets_after(17);
    assert_eq!(log.len(), 17, "{log:?}");
    let guesses: Vec<u64> = log.iter().copied().filter(|&o| o < 512 << 10).collect();
    let want: Vec<u64> = (0..16).map(|i| (i * PIECE) as u64).collect();
    assert_eq!(guesses, want, "every piece read once, in order");
}

#[test]
fn a_cancelled_guess_reads_only_what_was_in_the_device() {
    let (io, gate, arena) = stage();
    let guess = send(&io, &arena, Priority::Guess, 0, 16);
    assert_eq!(gate.offsets_after(8).len(), 8);
    io.cancel(guess);
    gate.release(8);
    wait_done(&io, guess);
    assert_eq!(io.cancelled_bytes(), (8 * PIECE) as u64);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(gate.offsets_after(8).len(), 8, "nothing more was read");
    assert_eq!(io.outstanding_bytes(), 0);
    assert_eq!(io.tickets_held(), 0);
}

#[test]
fn a_promoted_guess_goes_ahead_of_queued_read_ahead() {
    let (io, gate, arena) = stage();
    let ahead = send(&io, &arena, Priority::Prefetch, 0, 16);
    assert_eq!(gate.offsets_after(8).len(), 8, "read-ahead fills the window");
    let guess = send(&io, &arena, Priority::Guess, 512 << 10, 2);
    io.promote(guess);
    gate.release(1);
    let log = gate.offsets_after(9);
    assert_eq!(log[8], 512 << 10, "the promoted guess is next: {log:?}");
    gate.release(1000);
    wait_done(&io, guess);
    wait_done(&io, ahead);
    // 16 read-ahead pieces and the promoted guess's 2.
    assert_eq!(gate.offsets_after(18).len(), 18);
}

/// The needed-busy total once the I/O thread has closed the open period: a ticket is done
/// before the thread accounts for it, so an open period still grows between two readings.
fn needed_busy_once_closed(io: &IoStage) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, first) = io.needed_busy();
        std::thread::sleep(Duration::from_millis(2));
        let (_, second) = io.needed_busy();
        if first == second {
            return second;
        }
        assert!(Instant::now() < deadline, "the needed-busy period never closed");
    }
}

#[test]
fn needed_busy_time_counts_demand_and_read_ahead_not_guesses() {
    let (io, gate, arena) = stage();
    let (_, before) = io.needed_busy();
    let demand = send(&io, &arena, Priority::Demand, 0, 1);
    // From the moment the read reached the device: on a loaded machine the I/O thread may take
    // a while to pick it up, and only then does the needed-busy period start.
    gate.offsets_after(1);
    std::thread::sleep(Duration::from_millis(30));
    gate.release(1);
    wait_done(&io, demand);
    let after_demand = needed_busy_once_closed(&io);
    assert!(after_demand - before >= 30_000_000, "the demand read was outstanding 30 ms or more");
    let guess = send(&io, &arena, Priority::Guess, 64 << 10, 1);
    gate.offsets_after(2);
    std::thread::sleep(Duration::from_millis(30));
    gate.release(1);
    wait_done(&io, guess);
    let (_, after_guess) = io.needed_busy();
    assert_eq!(after_guess, after_demand, "guesses are not time compute needed the device for");
}

/// Several devices (issue 31): a batch's reads go to their files' lanes and its ticket waits
/// for every lane; a read that fails on one device fails the ticket with that device's error,
/// never completing with the bytes missing, while the other device's reads still succeed.
#[test]
fn a_batch_split_over_devices_completes_on_both_and_a_failing_device_fails_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("data");
    let pattern: Vec<u8> = (0..64 * PIECE).map(|i| (i % 251) as u8).collect();
    std::fs::write(&path, &pattern).unwrap();
    // File 0 on device 0, file 1 (the same bytes) on device 1, whose reads all fail.
    let files = vec![path.clone(), path];
    let clean = IoOptions { kind: IoKind::Sim, sim: Some(SimOptions::fault_free(1)), ..IoOptions::default() };
    let failing =
        IoOptions { sim: Some(SimOptions { eio_ppm: 1_000_000, ..SimOptions::fault_free(2) }), ..clean.clone() };
    let buf = Arc::new(AlignedBuf::new(1 << 20, &BufOptions::default()).unwrap());
    let tracer = Arc::new(Tracer::new(false));
    let start = |lanes: &[IoOptions]| {
        IoStage::start_devices(&files, &[0, 1], lanes, &buf, PIECE as u64, Arc::clone(&tracer)).unwrap()
    };
    let arena = Arena::new(Arc::clone(&buf), false);
    let read = |io: &IoStage, files_read: &[usize]| {
        let ticket = io.reserve();
        let meta = OpMeta { name: "test read", kind: Priority::Demand.kind(), layer: None, expert: None };
        let mut slots: Vec<_> = files_read
            .iter()
            .enumerate()
            .map(|(i, _)| arena.slot(Region { off: i * 8 * PIECE, len: 8 * PIECE }))
            .collect();
        let ops = files_read
            .iter()
            .zip(&mut slots)
            .map(|(&file, slot)| {
                let target = slot.start_read(ticket);
                arena.op(target, 0, FileRange { file, offset: PIECE as u64, len: 8 * PIECE, min_len: 8 * PIECE }, meta)
            })
            .collect();
        io.submit(Priority::Demand, vec![(ticket, ops)]);
        (io.wait(ticket), slots)
    };
    let io = start(std::slice::from_ref(&clean));
    assert_eq!(io.devices(), 2);
    let (result, mut slots) = read(&io, &[0, 1]);
    result.unwrap();
    for slot in &mut slots {
        slot.landed();
        let filled = slot.filled().unwrap();
        assert_eq!(arena.bytes(filled), &pattern[PIECE..9 * PIECE]);
    }
    // A lane publishes its counters after it hands the completion over: settle first, as a
    // run's report does.
    assert!(io.settle(std::time::Duration::from_secs(10)), "the lanes settle");
    let per = io.device_stats();
    assert!(per[0].ops == 1 && per[1].ops == 1, "one read on each device: {per:?}");
    assert_eq!(io.stats().ops, 2);
    drop(io);
    let io = start(&[clean, failing]);
    let (result, _) = read(&io, &[0]);
    result.unwrap();
    let (result, _) = read(&io, &[0, 1]);
    let err = result.unwrap_err();
    assert!(err.to_string().contains("Input/output error"), "{err}");
    assert_eq!(crate::exit::Classify::exit_code(&*err), crate::exit::ExitCode::Io);
}
