//! Replica leases, duties and the janitor on PostgreSQL (docs/scaleout.md;
//! the timing rules are `rvbox_store_port::replica`). Every lease is on the
//! database clock (`now()`), never a replica's.

use rvbox_store_port::replica::{Duty, LeaseTimes, ReplicaId};

use crate::sessions::{to_i64, to_u64};
use crate::{Fail, PgStore};

fn interval_ms(ms: u64) -> f64 {
    #[allow(clippy::cast_precision_loss)]
    let s = ms as f64 / 1000.0;
    s
}

impl PgStore {
    /// Joins as a new replica: a random id, the next epoch, a fresh lease.
    /// Writes made for its clients' sessions carry this replica as their
    /// owner from now on.
    ///
    /// # Errors
    /// A database failure.
    pub fn join(&mut self, peer_addr: Option<&str>, times: LeaseTimes) -> Result<ReplicaId, Fail> {
        let mut id = [0u8; 16];
        self.entropy
            .fill(&mut id)
            .map_err(|e| Fail::Integrity(format!("random replica id: {e}")))?;
        let lease = interval_ms(times.lease_ms);
        let epoch: i64 = self.in_tx("join as a replica", |tx, _| {
            Ok(crate::prep::query_one(
                tx,
                "INSERT INTO replicas (replica_id, epoch, lease_expires, peer_addr)
                     VALUES ($1, nextval('replica_epochs'),
                             now() + make_interval(secs => $2), $3)
                     RETURNING epoch",
                &[&id.as_slice(), &lease, &peer_addr],
            )
            .map_err(Fail::db("join as a replica"))?
            .get(0))
        })?;
        let replica = ReplicaId {
            id,
            epoch: to_u64(epoch),
        };
        self.replica = Some(replica);
        self.lease_times = times;
        tracing::info!(epoch, "joined as a server replica");
        Ok(replica)
    }

    /// Renews this replica's lease; `false` when it had already ended (the
    /// replica is fenced and must join again).
    ///
    /// # Errors
    /// A database failure (the caller retries; its keeper fences it when
    /// no renewal succeeds in time).
    pub fn renew(&mut self) -> Result<bool, Fail> {
        let Some(r) = self.replica else {
            return Ok(false);
        };
        let lease = interval_ms(self.lease_times.lease_ms);
        let renewed = self.in_tx("renew the replica lease", |tx, _| {
            let renewed = crate::prep::execute(
                tx,
                "UPDATE replicas SET lease_expires = now() + make_interval(secs => $3)
                     WHERE replica_id = $1 AND epoch = $2 AND lease_expires > now()",
                &[&r.id.as_slice(), &to_i64(r.epoch), &lease],
            )
            .map_err(Fail::db("renew the replica lease"))?
                == 1;
            if renewed {
                crate::notify::heartbeat(tx)?;
            }
            Ok(renewed)
        })?;
        if !renewed {
            tracing::error!(epoch = r.epoch, "the replica lease had ended; not renewed");
        }
        Ok(renewed)
    }

    /// Takes or keeps `duty` for this replica: it is free, its holder's
    /// lease ended, or this replica holds it already; and this replica's
    /// own lease is live. Returns whether this replica holds it now.
    ///
    /// # Errors
    /// A database failure.
    pub fn hold_duty(&mut self, duty: Duty) -> Result<bool, Fail> {
        let Some(r) = self.replica else {
            return Ok(false);
        };
        let lease = interval_ms(self.lease_times.lease_ms);
        let held = self.in_tx("hold a duty", |tx, _| {
            Ok(crate::prep::execute(
                tx,
                "UPDATE duties SET replica_id = $2, epoch = $3,
                         lease_expires = now() + make_interval(secs => $4)
                     WHERE name = $1
                       AND (replica_id IS NULL OR lease_expires <= now()
                            OR (replica_id = $2 AND epoch = $3))
                       AND EXISTS (SELECT 1 FROM replicas
                                   WHERE replica_id = $2 AND epoch = $3 AND lease_expires > now())",
                &[&duty.name(), &r.id.as_slice(), &to_i64(r.epoch), &lease],
            )
            .map_err(Fail::db("hold a duty"))?
                == 1)
        })?;
        Ok(held)
    }

    /// Ends the live sessions whose replica's lease ended (the janitor's
    /// pass; run by the holder of [`Duty::Janitor`]), and forgets replicas
    /// whose lease ended more than an hour ago. Returns the sessions ended.
    ///
    /// # Errors
    /// A database failure.
    pub fn end_sessions_of_lost_replicas(&mut self, now_ms: i64) -> Result<u64, Fail> {
        let ended = self.in_tx("end sessions of lost replicas", |tx, _| {
            let n = crate::prep::execute(
                tx,
                "UPDATE sessions SET live = false, closed_ms = $1,
                         close_reason = 'the server replica holding its connection was lost'
                     WHERE live AND owner_replica IN
                         (SELECT replica_id FROM replicas WHERE lease_expires <= now())",
                &[&now_ms],
            )
            .map_err(Fail::db("end sessions of lost replicas"))?;
            crate::prep::execute(
                tx,
                "DELETE FROM replicas WHERE lease_expires < now() - interval '1 hour'
                   AND NOT EXISTS (SELECT 1 FROM sessions s
                                   WHERE s.live AND s.owner_replica = replicas.replica_id)",
                &[],
            )
            .map_err(Fail::db("forget lost replicas"))?;
            Ok(n)
        })?;
        if ended > 0 {
            tracing::warn!(sessions = ended, "sessions of lost server replicas ended");
        }
        Ok(ended)
    }

    /// Takes on the identity another connection of this process joined
    /// with (the lease keeper joins; the executor's store writes the
    /// sessions it owns).
    pub fn adopt_replica(&mut self, replica: ReplicaId, times: LeaseTimes) {
        self.replica = Some(replica);
        self.lease_times = times;
    }

    /// The server id every replica of this database shares (clients see
    /// one server), minted by the first caller.
    ///
    /// # Errors
    /// A database failure, or a stored id that is not 16 bytes.
    pub fn server_id(&mut self, now_ms: i64) -> Result<[u8; 16], Fail> {
        let fresh = rvbox_store::entropy::uuid_v7(&*self.entropy, now_ms)
            .map_err(|e| Fail::Integrity(format!("random server id: {e}")))?;
        let v: Vec<u8> = self.in_tx("read the server id", |tx, _| {
            crate::prep::execute(
                tx,
                "INSERT INTO store_meta (key, value) VALUES ('server_id', $1)
                 ON CONFLICT (key) DO NOTHING",
                &[&fresh.as_slice()],
            )
            .map_err(Fail::db("record the server id"))?;
            Ok(crate::prep::query_one(
                tx,
                "SELECT value FROM store_meta WHERE key = 'server_id'",
                &[],
            )
            .map_err(Fail::db("read the server id"))?
            .get(0))
        })?;
        <[u8; 16]>::try_from(v.as_slice())
            .map_err(|_| Fail::Integrity("store_meta.server_id is not 16 bytes".into()))
    }

    /// This replica, once joined.
    #[must_use]
    pub fn replica(&self) -> Option<ReplicaId> {
        self.replica
    }
}
