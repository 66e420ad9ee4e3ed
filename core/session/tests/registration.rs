//! Registration, fencing and takeover decisions (plan §6.2, R-6.2-03..12).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::{INSTANCE_A, INSTANCE_B, INSTANCE_C, SID_1, SID_2, hello, identity, instance, sid};
use rvbox_domain::error::Code;
use rvbox_session::{
    AcceptKind, Acceptance, ClientRecord, ConflictCause, LiveSession, PendingClaim, Registration,
    RegistrationError, TAKEOVER_GRANT_TTL_MS, TakeoverError, TakeoverGrant, ValidHello,
    authorize_takeover, decide_registration, validate_hello,
};

const T0: u64 = 1_700_000_000_000;
const SID_3: &str = "sid-0003-cccccccccccccccc";

fn valid(inst: &str) -> ValidHello {
    let mut h = hello();
    h.client_instance_id = inst.into();
    validate_hello(h, &identity().supported_minors).unwrap()
}

/// Client A live as SID_1 generation 3.
fn live_a() -> ClientRecord {
    ClientRecord {
        generation: 3,
        instance: Some(instance(INSTANCE_A)),
        live: Some(LiveSession {
            session_id: sid(SID_1),
            generation: 3,
        }),
        pending_claim: None,
        grant: None,
    }
}

fn accepted(r: Registration) -> Acceptance {
    match r {
        Registration::Accept(a) => a,
        other => panic!("expected acceptance, got {other:?}"),
    }
}

/// What the caller's transaction does with a decision.
fn apply(record: &mut ClientRecord, r: &Registration) {
    match r {
        Registration::Accept(a) => {
            record.generation = a.generation;
            record.instance = Some(a.instance);
            record.live = Some(LiveSession {
                session_id: a.session_id.clone(),
                generation: a.generation,
            });
            if a.consume_grant {
                record.grant.as_mut().unwrap().consumed = true;
            }
            if a.clear_pending_claim {
                record.pending_claim = None;
            }
        }
        Registration::RejectLiveConflict { claim, .. } => record.pending_claim = Some(*claim),
    }
}

#[test]
fn first_registration_is_fresh_generation_one() {
    let a = accepted(
        decide_registration(&ClientRecord::default(), &valid(INSTANCE_A), sid(SID_1), T0).unwrap(),
    );
    assert_eq!(a.kind, AcceptKind::Fresh);
    assert_eq!(a.generation, 1);
    assert_eq!(a.fence, None);
    assert!(!a.consume_grant);
}

#[test]
fn same_instance_replacement_fences_prior_and_increments_generation() {
    let record = live_a();
    let a = accepted(decide_registration(&record, &valid(INSTANCE_A), sid(SID_2), T0).unwrap());
    assert_eq!(a.kind, AcceptKind::Replace);
    assert_eq!(a.generation, 4);
    assert_eq!(
        a.fence,
        Some(LiveSession {
            session_id: sid(SID_1),
            generation: 3
        })
    );
    assert_eq!(a.session_id, sid(SID_2));
    assert!(!a.consume_grant);
}

#[test]
fn different_instance_without_live_session_is_accepted_without_grant() {
    let mut record = live_a();
    record.live = None;
    // an unrelated grant for B exists: it is neither required nor consumed
    record.grant = Some(TakeoverGrant {
        instance: instance(INSTANCE_B),
        expires_wall_ms: T0 + 1,
        consumed: false,
    });
    let a = accepted(decide_registration(&record, &valid(INSTANCE_B), sid(SID_2), T0).unwrap());
    assert_eq!(a.kind, AcceptKind::NewInstance);
    assert_eq!(a.generation, 4);
    assert_eq!(a.fence, None);
    assert!(!a.consume_grant);
    assert_eq!(a.instance, instance(INSTANCE_B));
}

#[test]
fn different_instance_while_live_records_pending_claim_and_rejects() {
    let mut record = live_a();
    let r = decide_registration(&record, &valid(INSTANCE_B), sid(SID_2), T0).unwrap();
    assert_eq!(
        r,
        Registration::RejectLiveConflict {
            claim: PendingClaim {
                instance: instance(INSTANCE_B),
                observed_wall_ms: T0
            },
            live: record.live.clone().unwrap(),
            cause: ConflictCause::NoGrant,
        }
    );
    let e = r.rejection().unwrap();
    assert_eq!(e.code(), Code::LiveConflict);
    apply(&mut record, &r);
    assert_eq!(
        record.pending_claim.map(|c| c.instance),
        Some(instance(INSTANCE_B))
    );
    // the generation did not move and A stays live
    assert_eq!(record.generation, 3);
    assert_eq!(record.live.as_ref().unwrap().session_id, sid(SID_1));
}

#[test]
fn takeover_grant_is_consumed_exactly_once() {
    let mut record = live_a();
    let rejected = decide_registration(&record, &valid(INSTANCE_B), sid(SID_2), T0).unwrap();
    apply(&mut record, &rejected);
    let grant = authorize_takeover(
        &record,
        instance(INSTANCE_B),
        T0 + 10,
        TAKEOVER_GRANT_TTL_MS,
    )
    .unwrap();
    assert_eq!(grant.expires_wall_ms, T0 + 10 + 300_000);
    record.grant = Some(grant);

    let r = decide_registration(&record, &valid(INSTANCE_B), sid(SID_2), T0 + 20).unwrap();
    let a = accepted(r.clone());
    assert_eq!(a.kind, AcceptKind::Takeover);
    assert!(a.consume_grant);
    assert!(a.clear_pending_claim);
    assert_eq!(a.generation, 4);
    assert_eq!(a.fence.as_ref().map(|l| l.generation), Some(3));
    apply(&mut record, &r);
    assert!(record.grant.unwrap().consumed);

    // a second, different instance while B is live: rejected, no grant use
    let r = decide_registration(&record, &valid(INSTANCE_C), sid(SID_3), T0 + 30).unwrap();
    assert!(matches!(
        r,
        Registration::RejectLiveConflict {
            cause: ConflictCause::GrantForOtherInstance,
            ..
        }
    ));
    // and A (the fenced instance) cannot come back on B's consumed grant
    let r = decide_registration(&record, &valid(INSTANCE_A), sid(SID_3), T0 + 30).unwrap();
    assert!(matches!(r, Registration::RejectLiveConflict { .. }));
}

#[test]
fn consumed_grant_is_not_reused_by_the_same_instance_after_a_new_conflict() {
    let mut record = live_a();
    record.grant = Some(TakeoverGrant {
        instance: instance(INSTANCE_B),
        expires_wall_ms: T0 + 1_000,
        consumed: true,
    });
    let r = decide_registration(&record, &valid(INSTANCE_B), sid(SID_2), T0).unwrap();
    assert!(matches!(
        r,
        Registration::RejectLiveConflict {
            cause: ConflictCause::GrantConsumed,
            ..
        }
    ));
}

#[test]
fn takeover_grant_for_other_instance_is_never_broadened() {
    let mut record = live_a();
    record.pending_claim = Some(PendingClaim {
        instance: instance(INSTANCE_B),
        observed_wall_ms: T0,
    });
    record.grant = Some(TakeoverGrant {
        instance: instance(INSTANCE_B),
        expires_wall_ms: T0 + TAKEOVER_GRANT_TTL_MS,
        consumed: false,
    });
    let r = decide_registration(&record, &valid(INSTANCE_C), sid(SID_2), T0 + 1).unwrap();
    match &r {
        Registration::RejectLiveConflict { claim, cause, .. } => {
            assert_eq!(*cause, ConflictCause::GrantForOtherInstance);
            // C replaces the pending claim; B's grant stays untouched
            assert_eq!(claim.instance, instance(INSTANCE_C));
        }
        other => panic!("{other:?}"),
    }
    apply(&mut record, &r);
    assert!(!record.grant.unwrap().consumed);
}

#[test]
fn takeover_grant_expiry_is_exclusive_at_the_expiry_instant() {
    // Decision: a grant is valid on [authorized, expires): at exactly the
    // expiry instant it has expired.
    let mut record = live_a();
    let expires = T0 + TAKEOVER_GRANT_TTL_MS;
    record.grant = Some(TakeoverGrant {
        instance: instance(INSTANCE_B),
        expires_wall_ms: expires,
        consumed: false,
    });
    let a = accepted(
        decide_registration(&record, &valid(INSTANCE_B), sid(SID_2), expires - 1).unwrap(),
    );
    assert_eq!(a.kind, AcceptKind::Takeover);
    for now in [expires, expires + 1] {
        let r = decide_registration(&record, &valid(INSTANCE_B), sid(SID_2), now).unwrap();
        assert_eq!(
            r,
            Registration::RejectLiveConflict {
                claim: PendingClaim {
                    instance: instance(INSTANCE_B),
                    observed_wall_ms: now
                },
                live: record.live.clone().unwrap(),
                cause: ConflictCause::GrantExpired,
            },
            "at {now}"
        );
    }
    assert!(
        record
            .grant
            .unwrap()
            .admits(instance(INSTANCE_B), expires - 1)
    );
    assert!(!record.grant.unwrap().admits(instance(INSTANCE_B), expires));
}

#[test]
fn authorize_takeover_requires_the_exact_pending_claim() {
    let mut record = live_a();
    assert_eq!(
        authorize_takeover(&record, instance(INSTANCE_B), T0, TAKEOVER_GRANT_TTL_MS),
        Err(TakeoverError::NoPendingClaim)
    );
    record.pending_claim = Some(PendingClaim {
        instance: instance(INSTANCE_B),
        observed_wall_ms: T0,
    });
    assert!(matches!(
        authorize_takeover(&record, instance(INSTANCE_C), T0, TAKEOVER_GRANT_TTL_MS),
        Err(TakeoverError::ClaimMismatch { .. })
    ));
    assert_eq!(
        authorize_takeover(&record, instance(INSTANCE_B), u64::MAX, 1),
        Err(TakeoverError::ExpiryOverflow)
    );
    let g = authorize_takeover(&record, instance(INSTANCE_B), T0, TAKEOVER_GRANT_TTL_MS).unwrap();
    assert_eq!(TAKEOVER_GRANT_TTL_MS, 5 * 60 * 1000);
    assert_eq!(
        g,
        TakeoverGrant {
            instance: instance(INSTANCE_B),
            expires_wall_ms: T0 + TAKEOVER_GRANT_TTL_MS,
            consumed: false
        }
    );
}

#[test]
fn registration_refuses_inconsistent_records() {
    let mut record = live_a();
    record.instance = None;
    assert!(matches!(
        decide_registration(&record, &valid(INSTANCE_A), sid(SID_2), T0),
        Err(RegistrationError::InconsistentRecord(_))
    ));
    let mut record = live_a();
    record.live.as_mut().unwrap().generation = 9;
    assert!(matches!(
        decide_registration(&record, &valid(INSTANCE_A), sid(SID_2), T0),
        Err(RegistrationError::InconsistentRecord(_))
    ));
    let record = live_a();
    assert_eq!(
        decide_registration(&record, &valid(INSTANCE_A), sid(SID_1), T0),
        Err(RegistrationError::SessionIdReused)
    );
    let record = ClientRecord {
        generation: u64::MAX,
        ..ClientRecord::default()
    };
    assert_eq!(
        decide_registration(&record, &valid(INSTANCE_A), sid(SID_1), T0),
        Err(RegistrationError::GenerationExhausted {
            generation: u64::MAX
        })
    );
}
