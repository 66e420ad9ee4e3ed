//! Properties: arbitrary input never panics, the session closes at most
//! once, and nothing is acknowledged without a durable report.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::{Harness, closes, frame, hello, hello_frame};
use proptest::prelude::*;
use rvbox_proto::v1::envelope::Payload;
use rvbox_session::{Effect, Input, negotiate_minor};

proptest! {
    #[test]
    fn arbitrary_frames_never_panic_and_close_at_most_once(
        frames in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 0..8),
        established in any::<bool>(),
    ) {
        let mut h = if established { Harness::ready(1) } else { Harness::new() };
        let mut all = Vec::new();
        for (i, f) in frames.into_iter().enumerate() {
            let t = u64::try_from(i).unwrap() * 1_000;
            all.extend(h.at(t, Input::Binary(f)));
        }
        prop_assert!(closes(&all).len() <= 1);
        // random bytes are never acknowledged as events
        let acked = all.iter().any(|e| matches!(e,
            Effect::Send { envelope, .. } if matches!(envelope.payload, Some(Payload::EventAck(_)))));
        prop_assert!(!acked);
    }

    #[test]
    fn negotiated_minor_is_the_highest_shared(
        client in proptest::collection::btree_set(0u32..20, 1..8),
        server in proptest::collection::btree_set(0u32..20, 1..8),
    ) {
        let c: Vec<u32> = client.iter().copied().collect();
        let s: Vec<u32> = server.iter().copied().collect();
        let want = client.intersection(&server).copied().max();
        prop_assert_eq!(negotiate_minor(&c, &s), want);
    }

    #[test]
    fn any_event_sequence_before_durable_is_never_acked(
        seqs in proptest::collection::vec(1u64..6, 1..12),
    ) {
        let mut h = Harness::ready(1);
        for seq in seqs {
            let fx = h.event(common::output_event(common::ISSUE_1, seq, 3));
            prop_assert!(common::acks(&fx).is_empty());
            if !closes(&fx).is_empty() {
                break;
            }
        }
    }
}

#[test]
fn hello_then_garbage_is_one_close() {
    let mut h = Harness::new();
    h.input(Input::Binary(hello_frame(hello())));
    let fx = h.input(Input::Binary(frame("", 0, Payload::ClientHello(hello()))));
    assert_eq!(closes(&fx).len(), 1);
    assert!(h.input(Input::Binary(vec![1, 2, 3])).is_empty());
}
